"""Executor code the driver runs: the training loss on a probe batch (``driver/loss_probe.py``
builds the batch and decides when), exactly as a rank computes it on its first batch."""

from __future__ import annotations

import torch

from ...shared.spec import ColumnSpec
from ..data.batch import check_transformed
from ..data.convert import reshape_input
from .loss import BatchLoss, as_outputs
from .objects import build_losses


def probe_loss(
    objects: dict,
    chunk: dict[str, torch.Tensor],
    features: list[ColumnSpec],
    labels: list[ColumnSpec],
    sample_weight: ColumnSpec | None,
    feature_shapes: list,
    loss_weights,
    transformation_fn,
) -> None:
    """The loss of ``objects`` (the unpickled training bundle) on ``chunk`` (the loader's
    column tensors) through the model on the CPU, in eval mode, without gradients. Raises
    what ``BatchLoss`` raises (``LossFailed`` when the loss itself fails), and a TypeError or
    ValueError for a ``transformation_fn`` that returns no batch or was written for Horovod's
    batches (``check_not_written_for_horovod``); a model or ``transformation_fn`` failing
    otherwise, or a ``train_minibatch_fn`` (whose step decides what reaches the loss), ends it
    quietly: the executors decide on the real rows."""
    if objects.get("train_minibatch_fn") is not None:
        return
    rows = len(next(iter(chunk.values())))
    if transformation_fn is not None:
        try:
            out = transformation_fn(dict(chunk))
        except Exception as e:
            check_not_written_for_horovod(transformation_fn, chunk, e)
            return  # it may need real rows: the executors report it
        columns = features + labels + ([sample_weight] if sample_weight else [])
        chunk = check_transformed(out, columns, rows)
    try:
        inputs = [reshape_input(c.name, chunk[c.name], s) for c, s in zip(features, feature_shapes)]
        losses = build_losses(objects["loss"], objects.get("loss_constructors"), len(labels))
        model = objects["model"].cpu().eval()
        with torch.no_grad():
            outputs = as_outputs(model(*inputs))
    except Exception:
        return  # not the loss's doing: the executors report it on the real rows
    for loss_fn in losses:
        if isinstance(loss_fn, torch.nn.Module):
            loss_fn.cpu()
    loss = BatchLoss(losses, labels, loss_weights, weighted_rows=sample_weight is not None)
    with torch.no_grad():
        loss(
            outputs,
            [chunk[c.name] for c in labels],
            chunk[sample_weight.name] if sample_weight is not None else None,
        )


def check_not_written_for_horovod(fn, chunk: dict[str, torch.Tensor], error: Exception) -> None:
    """A TypeError saying what ``fn`` receives here when it failed (``error``) on a dict of
    tensors but runs on a batch as Horovod's estimator gives it: a pandas DataFrame
    (Petastorm's ``TransformSpec``) or a dict of NumPy arrays. Nothing when it fails on
    those too: then it is not the form's doing."""
    given = ", ".join(
        f"'{name}': {str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
        for name, t in chunk.items()
    )
    for form, batch in _horovod_forms(chunk):
        try:
            fn(batch)
        except Exception:
            continue
        raise TypeError(
            f"transformation_fn: fails on a batch as it is given here, a dict of column name "
            f"-> torch.Tensor on the CPU ({{{given}}}), with {type(error).__name__}: {error}; "
            f"it runs on {form}, as Horovod's estimator gives its batches. Write it for "
            "tensors and return the dict: e.g. batch['x'] = batch['x'].to(torch.float32) "
            "where Horovod's had df['x'] = df['x'].astype(np.float32) (docs/horovod.md)"
        ) from None


def _horovod_forms(chunk: dict[str, torch.Tensor]):
    """The batch as a pandas DataFrame (an array column: one NumPy array per row) and as a
    dict of NumPy arrays, each made anew (a function may change its batch)."""
    try:
        import pandas as pd
    except ImportError:
        pd = None
    if pd is not None:
        columns = {n: t.numpy() if t.dim() == 1 else list(t.numpy()) for n, t in chunk.items()}
        yield "a pandas DataFrame", pd.DataFrame(columns)
    yield "a dict of NumPy arrays", {n: t.numpy().copy() for n, t in chunk.items()}
