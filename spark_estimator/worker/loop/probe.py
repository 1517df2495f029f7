"""Executor code the driver runs: the training loss on a probe batch (the driver's ``check_loss``
builds the batch and decides when), exactly as a rank computes it on its first batch."""

from __future__ import annotations

import functools
import re
import warnings

import torch

from ...shared.spec import ColumnSpec
from ..data.batch import check_transformed
from ..data.convert import reshape_input
from .loss import BatchLoss, LossFailed, as_outputs
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
    label_ranges: dict[str, list[int]] | None = None,
) -> None:
    """The loss of ``objects`` (the unpickled training bundle) on ``chunk`` (the loader's
    column tensors) through the model on the CPU, in eval mode, without gradients; a label
    column of ``label_ranges`` holds its smallest and largest value (the chunk's two rows).
    Raises what ``BatchLoss`` raises: ``LossFailed`` when the loss itself fails, but a
    ValueError saying what to change when that loss is torch's own (``torch_loss``), which
    fails only on the shapes, dtypes or values of the model's output and the labels, as
    when torch warns that a target size differs from the input size (it would broadcast
    them: silently wrong). ``LayerFailed`` when one of torch's own layers of the model
    raises a shape mismatch on the chunk (``_forward``). Also a TypeError or
    ValueError for a ``transformation_fn`` that returns no batch or was written for Horovod's
    batches (``check_not_written_for_horovod``); a model (its own code, a GPU-only or
    ``meta``-built model) or ``transformation_fn`` failing otherwise, or a
    ``train_minibatch_fn`` (whose step decides what reaches the loss), ends it quietly: the
    executors decide on the real rows."""
    if objects.get("train_minibatch_fn") is not None:
        return
    rows = len(next(iter(chunk.values())))
    chunk = dict(chunk)
    for c in labels:
        if label_ranges and c.name in label_ranges and rows == 2 and c.kind == "scalar":
            chunk[c.name] = torch.tensor(label_ranges[c.name], dtype=c.torch_dtype)
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
        outputs = as_outputs(_forward(model, inputs))
    except LayerFailed:
        raise
    except Exception:
        return  # not the loss's doing: the executors report it on the real rows
    for loss_fn in losses:
        if isinstance(loss_fn, torch.nn.Module):
            loss_fn.cpu()
    loss = BatchLoss(losses, labels, loss_weights, weighted_rows=sample_weight is not None)
    label_values = [chunk[c.name] for c in labels]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="Using a target size", category=UserWarning)
        try:
            loss(
                outputs,
                label_values,
                chunk[sample_weight.name] if sample_weight is not None else None,
            )
        except LossFailed as e:
            i = e.index
            if not torch_loss(losses[i]) or _on_a_device(e.__cause__):
                raise
            ranges = label_ranges or {}
            hint = _what_to_change(
                outputs[i], label_values[i], labels[i], ranges.get(labels[i].name), e.__cause__
            )
            raise ValueError(
                f"{e}, tried on the driver on {rows} rows ({_rows_tried(labels[i], ranges)}); "
                f"torch's {_name(losses[i])} fails the same way in training: {hint}"
            ) from None


class LayerFailed(Exception):
    """One of torch's own layers of the model (``name``: its path in the model, e.g.
    ``'0'`` or ``'encoder.fc'``) raised a shape mismatch on the probe batch's ``inputs``:
    it needs nothing a rank has, so it fails the same way on every rank."""

    def __init__(self, name: str, layer: torch.nn.Module, error: Exception, inputs: list):
        super().__init__(f"{name or 'model'}: {type(error).__name__}: {error}")
        self.name, self.layer, self.error = name, layer, error
        self.shapes = [tuple(t.shape) for t in inputs]


# words of the errors torch's layers raise on input of the wrong shape ("mat1 and mat2
# shapes cannot be multiplied", "expected input[2, 1, 8, 8] to have 3 channels", "Expected
# 3D (unbatched) or 4D (batched) input", "running_mean should contain 4 elements not 5",
# "input.size(-1) must be equal to input_size", "was expecting embedding dimension of 5")
_SHAPE_WORDS = re.compile(r"shape|size|channel|dimension|elements|\b\dD\b", re.I)


def _torch_layer(module: torch.nn.Module) -> bool:
    """A layer of ``torch.nn`` itself (``Linear``, ``Conv2d``, ``LSTM``...), not a container,
    which runs only its own code."""
    containers = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)
    return type(module).__module__.startswith("torch.nn.modules.") and not isinstance(
        module, containers
    )


def _forward(model: torch.nn.Module, inputs: list[torch.Tensor]):
    """``model(*inputs)`` without gradients; ``LayerFailed`` where one of torch's own
    layers raises a shape mismatch and does again on inputs of other values (a model may
    pick its rows by their values, which zeros would not show)."""
    running: list[tuple[str, torch.nn.Module]] = []
    names = {id(m): n for n, m in model.named_modules()}

    def enter(module, args):
        running.append((names.get(id(module), "?"), module))

    def leave(module, args, output):
        while running and running.pop()[1] is not module:
            pass  # a child whose error the module caught

    hooks = []
    try:
        for module in model.modules():
            hooks.append(module.register_forward_pre_hook(enter))
            hooks.append(module.register_forward_hook(leave))
        with torch.no_grad():
            try:
                return model(*inputs)
            except Exception as e:
                failed, error = running[-1] if running else None, e
                if failed is None or not _shape_mismatch(failed[1], e):
                    raise
            running.clear()
            other = torch.Generator().manual_seed(0)
            others = [
                torch.randn(t.shape, generator=other, dtype=t.dtype) if t.is_floating_point() else t
                for t in inputs
            ]
            try:
                model(*others)
            except Exception as again:
                if running and running[-1][1] is failed[1] and _shape_mismatch(failed[1], again):
                    raise LayerFailed(failed[0], failed[1], error, inputs) from None
            raise error
    finally:
        for hook in hooks:
            hook.remove()


def _shape_mismatch(module: torch.nn.Module, error: Exception) -> bool:
    return (
        _torch_layer(module)
        and isinstance(error, (RuntimeError, ValueError, IndexError, AssertionError))
        and not _on_a_device(error)
        and bool(_SHAPE_WORDS.search(str(error)))
    )


def torch_loss(fn) -> bool:
    """Whether ``fn`` is one of torch's own losses (a loss module of ``torch.nn``, or a
    function of ``torch.nn.functional``): it needs no rank, process group or device, so
    what it fails on in the probe it fails on in training."""
    if isinstance(fn, functools.partial):
        fn = fn.func
    owner = type(fn) if isinstance(fn, torch.nn.Module) else fn
    return getattr(owner, "__module__", "") in ("torch.nn.modules.loss", "torch.nn.functional")


def _name(fn) -> str:
    fn = fn.func if isinstance(fn, functools.partial) else fn
    return type(fn).__name__ if isinstance(fn, torch.nn.Module) else fn.__name__


def _on_a_device(error: BaseException | None) -> bool:
    text = str(error).lower()
    return "device" in text or "cuda" in text


def _rows_tried(spec: ColumnSpec, ranges: dict[str, list[int]]) -> str:
    if spec.name in ranges:
        low, high = ranges[spec.name]
        return (
            f"features of zeros; label '{spec.name}' its smallest and largest values in the "
            f"data, {low} and {high}"
        )
    return "of zeros"


def _what_to_change(
    output: torch.Tensor,
    label: torch.Tensor,
    spec: ColumnSpec,
    label_range: list[int] | None,
    error: BaseException | None,
) -> str:
    """What to change so that the model's ``output`` and the ``label`` column fit the loss
    that failed with ``error``."""
    shape = ["B", *output.shape[1:]]
    if label.is_floating_point() and "expected target dtype to be long" in str(error).lower():
        return (
            f"this loss takes class indices: give label column '{spec.name}' as whole numbers "
            f"of an integer type, e.g. df.withColumn('{spec.name}', F.col('{spec.name}')"
            ".cast('long')), or set classification=True"
        )
    if not label.is_floating_point() and spec.kind == "scalar":
        if label_range is not None and output.dim() == 2 and label_range[1] >= output.shape[1]:
            classes = label_range[1] + 1
            return (
                f"label column '{spec.name}' holds class indices up to {label_range[1]}, so "
                f"the model must return [B, {classes}] class scores (at least {classes} "
                f"outputs; it returns {shape})"
            )
        return (
            f"a label column of class indices ('{spec.name}') needs class scores [B, C] from "
            f"the model (it returns {shape}), C more than the largest class index"
        )
    per_row = output[0].numel() if len(output) else 0
    label_per_row = label[0].numel() if len(label) else 0
    if per_row != label_per_row:
        return (
            f"the model returns {per_row} values per row (output {shape}) for label column "
            f"'{spec.name}' of {label_per_row} per row; make them match (e.g. the last "
            "layer's out_features), or, for classes, use a loss of class indices such as "
            "CrossEntropyLoss with whole-number labels"
        )
    return f"make the model's output ({shape}) and label column '{spec.name}' fit this loss"


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
    import pandas as pd  # a dependency of the package; imported only where needed

    columns = {n: t.numpy() if t.dim() == 1 else list(t.numpy()) for n, t in chunk.items()}
    yield "a pandas DataFrame", pd.DataFrame(columns)
    yield "a dict of NumPy arrays", {n: t.numpy().copy() for n, t in chunk.items()}
