"""Driver: the loss tried on a probe batch, so that a loss that cannot work fails here.

Two rows of zeros, in the per-row shapes and dtypes the executors load (features reshaped
by ``input_shapes``, after ``transformation_fn``), go through a copy of the model in eval
mode and the executors' own ``BatchLoss`` on the CPU, without gradients. What its checks
find is refused with the executors' messages: ``label_cols: the model returned N outputs
...``, ``sample_weight_col: the loss for label column ... returned shape ...``. The loss
itself raising (``loss: failed on ...``) is refused too when it is torch's own loss
(``CrossEntropyLoss``, ``MSELoss``, ``F.cross_entropy``...), which needs nothing a rank
has, saying the shapes and what to change (torch's warning that a target size differs
from the input's, about to broadcast, counts as a failure); another loss raising is only a
warning: it may need what only a rank has (its GPU, the process group), so the executors
decide on the real rows. Once the data is materialized, a class-index label column's
smallest and largest values are known (``DatasetInfo.label_ranges``): the probe runs again
with them as its labels, so class scores too few for the classes fail here.

The probe needs every column's values per row: scalars have one; an array or vector
column's length comes from ``input_shapes`` or from the row lengths a
dataset records; variable columns (images, text, sequences), decoded on the executors, are
not probed. Before any Spark job only the first are known, so where an array column's
length is not, the probe runs once the dataset is (materialized or found), before the
training job. The model not fitting the columns is refused too: one of torch's own
layers (``Linear``, ``Conv2d``...) raising a shape mismatch on the probe batch, and again on
rows of other values (``worker.loop.probe``), with the feature columns, their shapes,
``input_shapes`` and the layer (``layer_message``). A model failing otherwise (its own code,
a GPU-only or ``meta``-built model, a model function) or a ``transformation_fn`` that fails
on zeros is no fault of the loss: the probe then stops, and the executors report what fails
on the real rows. With
``train_minibatch_fn`` the user's step decides what reaches the loss, so it is not probed.
"""

from __future__ import annotations

import logging

import torch

from ..shared.serialization import loads
from ..shared.shapes import row_length
from ..shared.spec import ColumnSpec
from ..worker.loop.loss import LossFailed
from ..worker.loop.probe import LayerFailed, probe_loss

_log = logging.getLogger(__name__)
ROWS = 2  # more than one, for models that need it (batch norm is in eval mode anyway)


def _row_length(
    column: ColumnSpec, row_lengths: dict[str, int], shape: list[int] | None
) -> int | None:
    if column.kind == "scalar":
        return 1
    if column.variable:  # decoded per row on the executors: not known here
        return None
    if column.name in row_lengths:
        return row_lengths[column.name]
    if shape:
        return row_length(shape)
    return None


def probe_chunk(
    columns: list[ColumnSpec], row_lengths: dict[str, int], shapes: list
) -> dict[str, torch.Tensor] | None:
    """``ROWS`` rows of zeros per column, as the loader hands them over; None when a
    column's values per row are not known."""
    chunk = {}
    for column, shape in zip(columns, shapes):
        length = _row_length(column, row_lengths, shape)
        if length is None:
            return None
        size = (ROWS,) if column.kind == "scalar" else (ROWS, length)
        chunk[column.name] = torch.zeros(size, dtype=column.torch_dtype)
    return chunk


def check_loss(
    bundle: bytes,
    features: list[ColumnSpec],
    labels: list[ColumnSpec],
    sample_weight: ColumnSpec | None,
    *,
    row_lengths: dict[str, int],
    input_shapes: list[list[int]] | None,
    loss_weights,
    transformation_fn: bytes | None,
    label_ranges: dict[str, list[int]] | None = None,
) -> bool:
    """Run the loss on a probe batch; raise what its checks find, and what torch's own loss
    fails on; warn when another loss raises. False when a column's values per row are not
    known yet (then call again with the dataset's row lengths). ``label_ranges``: the
    [min, max] of class-index label columns, which the probe's two rows then hold."""
    weights = [sample_weight] if sample_weight is not None else []
    feature_shapes = list(input_shapes or [None] * len(features))
    chunk = probe_chunk(
        features + labels + weights,
        row_lengths,
        feature_shapes + [None] * (len(labels) + len(weights)),
    )
    if chunk is None:
        return False
    if sample_weight is not None:
        chunk[sample_weight.name] += 1
    try:
        probe_loss(
            loads(bundle),  # copies: the user's model and loss stay as they are
            chunk,
            features,
            labels,
            sample_weight,
            feature_shapes,
            loss_weights,
            loads(transformation_fn) if transformation_fn is not None else None,
            label_ranges,
        )
    except LayerFailed as e:
        if any(c.kind != "scalar" and c.name not in row_lengths for c in features):
            # a length taken from input_shapes alone may be the mistake: once the data's
            # lengths are known, their check against input_shapes names it, else this does
            return False
        raise ValueError(layer_message(e, features, feature_shapes)) from None
    except LossFailed as e:
        _log.warning(
            "%s; tried on the driver, on %d rows of zeros: training goes on, and the "
            "executors report it if the real rows fail too",
            e,
            ROWS,
        )
    return True


def layer_message(failed: LayerFailed, features: list[ColumnSpec], input_shapes: list) -> str:
    """One short message for a layer of torch that does not fit the feature columns."""
    shown = ", ".join(
        f"'{c.name}' [{', '.join(['B', *map(str, shape[1:])])}]"
        for c, shape in zip(features, failed.shapes)
    )
    given = [s for s in input_shapes if s is not None]
    shapes = f"input_shapes={input_shapes}" if given else "no input_shapes"
    layer = f"layer '{failed.name}' ({failed.layer})" if failed.name else str(failed.layer)
    return (
        f"model: {layer} does not fit the feature columns "
        f"{shown} ({shapes}): {type(failed.error).__name__}: {failed.error}; tried on the "
        f"driver on {ROWS} rows; make the layer fit the columns, or the columns the layer "
        "(input_shapes reshapes a column's rows)"
    )
