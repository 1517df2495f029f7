"""Executor code the driver runs: the training loss on a probe batch (``driver/loss_probe.py``
builds the batch and decides when), exactly as a rank computes it on its first batch."""

from __future__ import annotations

import torch

from ...shared.spec import ColumnSpec
from ..data.batch import apply_transformation
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
    what ``BatchLoss`` raises (``LossFailed`` when the loss itself fails); a model or
    ``transformation_fn`` failing first, or a ``train_minibatch_fn`` (whose step decides what
    reaches the loss), ends it quietly: the executors decide on the real rows."""
    if objects.get("train_minibatch_fn") is not None:
        return
    rows = len(next(iter(chunk.values())))
    try:
        if transformation_fn is not None:
            columns = features + labels + ([sample_weight] if sample_weight else [])
            chunk = apply_transformation(transformation_fn, chunk, columns, rows)
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
