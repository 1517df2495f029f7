"""Executor: batched inference for TorchModel.transform, one Arrow batch at a time.

The model is unpickled once per task and run under ``torch.no_grad()`` on whole Arrow
batches (``spark.sql.execution.arrow.maxRecordsPerBatch`` rows each), on the GPU Spark
assigned the task if any, else on CPU. Input columns pass through untouched.

With ``classification`` the model's one output is read as class logits and becomes three
columns, as Spark ML classifiers write them: the logits (``rawPrediction``), the class
probabilities and the class index, see ``class_columns``.

NaN and infinite feature values are not refused (transform's rows are the caller's): the
model computes what it computes for them, a classifier's row whose logits are not all
finite gets ``prediction`` NaN rather than a class, and each batch holding such values logs
a warning naming the columns (``warn_non_finite``; docs/bad-input.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa
import torch

from ..shared.serialization import loads
from ..shared.spec import ColumnSpec, DecodeSpec
from .comm.device import task_device
from .data.convert import column_to_tensor, reshape_input, tensor_to_arrow
from .loop.loss import as_outputs
from .predict_decode import decoded_batches, decoder_for, release

_log = logging.getLogger(__name__)


def predict_batches(
    batches: Iterator[pa.RecordBatch],
    model_bytes: bytes,
    features: list[ColumnSpec],
    input_shapes: list[list[int]] | None,
    output_cols: list[str],
    scalar_outputs: list[bool],
    classification: bool = False,
    decode: DecodeSpec | None = None,
    row_names: str | None = None,
    fit_labels: list[str] | None = None,
) -> Iterator[pa.RecordBatch]:
    """Append the model's outputs to each batch: one column per output (a double where
    ``scalar_outputs`` says so, else array<float>), or with ``classification`` the three
    columns of ``class_columns`` named by ``output_cols`` (raw, probability, prediction).
    Variable columns are decoded as in training's validation (``decode``: no augmentation),
    a row that fails naming ``row_names``' value where given, a decode_fn that reads one of
    the fit's ``fit_labels`` (not in transform's rows) told so."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    device = predict_device(ctx)
    model = loads(model_bytes).to(device).eval()
    task = f"transform's task {ctx.partitionId()}" if ctx else "transform"
    yield from predict_with(
        model,
        device,
        task,
        batches,
        features,
        input_shapes,
        output_cols,
        scalar_outputs,
        classification,
        decode,
        row_names,
        fit_labels,
    )


def predict_device(ctx) -> torch.device:
    """Where predictions run: in a Spark task (``ctx``), the GPU Spark assigned it, else
    the CPU; outside Spark (an MLflow model served or loaded in Python), this process's
    current GPU where torch has one, else the CPU."""
    if ctx is not None:
        return task_device(ctx, use_gpu="auto", warn=False)[0]
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def predict_with(
    model: torch.nn.Module,
    device: torch.device,
    task: str,
    batches: Iterable[pa.RecordBatch],
    features: list[ColumnSpec],
    input_shapes: list[list[int]] | None,
    output_cols: list[str],
    scalar_outputs: list[bool],
    classification: bool = False,
    decode: DecodeSpec | None = None,
    row_names: str | None = None,
    fit_labels: list[str] | None = None,
) -> Iterator[pa.RecordBatch]:
    """``predict_batches`` with the module already on ``device`` in eval mode (also the
    MLflow model's ``predict``); ``task`` names the caller in decoding errors."""
    expected = 1 if classification else len(output_cols)
    decoder, finished = None, False
    prepared: Iterable = ((batch, None) for batch in batches if batch.num_rows)
    try:
        if any(c.variable for c in features):
            decoder = decoder_for(
                decode or DecodeSpec(),
                features,
                row_names,
                list(fit_labels or []),
                task,
                device.type == "cuda",
            )
            prepared = decoded_batches(batches, features, row_names, decoder)
        with torch.no_grad():
            for batch, decoded in prepared:
                inputs = _inputs(batch, features, input_shapes, decoder, decoded, device, task)
                yield _predicted(
                    model,
                    inputs,
                    batch,
                    output_cols,
                    expected,
                    classification,
                    scalar_outputs,
                    input_shapes,
                )
        finished = True
    finally:
        if decoder is not None:
            release(decoder, finished)


def _inputs(batch, features, input_shapes, decoder, decoded, device, task) -> list:
    """forward()'s arguments for an Arrow batch: each feature column as a tensor (a
    variable one as ``decoded``, a sequence's mask after it), on ``device``; non-finite
    values of the fixed columns warned of (``warn_non_finite``)."""
    shapes = input_shapes or [None] * len(features)
    fixed = {
        c.name: column_to_tensor(c.name, batch.column(c.name), c.torch_dtype, "transform")
        for c in features
        if not c.variable
    }
    warn_non_finite(fixed, batch.num_rows, task)
    masks = {}
    if decoded is not None:
        decoder.on_device(decoded, device)
        fixed.update(decoded.columns)
        masks = decoded.masks
    inputs = []
    for c, shape in zip(features, shapes):
        value = fixed[c.name]
        if isinstance(value, torch.Tensor):  # else strings, as decode_fn left them
            value = reshape_input(c.name, value, shape).to(device)
        inputs.append(value)
        if c.name in masks:
            inputs.append(masks[c.name].to(device))
    return inputs


def warn_non_finite(columns: dict[str, torch.Tensor], rows: int, task: str) -> None:
    """Log a warning naming each floating-point column of ``columns`` (a batch's feature
    tensors, rows first) that holds NaN or infinite values, with how many of the ``rows``
    hold them: their outputs are what the model computes for them (NaN, mostly), and a
    classifier gives such a row a class only where its logits are finite."""
    counts = {}
    for name, values in columns.items():
        if values.is_floating_point() and not bool(torch.isfinite(values).all()):
            bad = ~torch.isfinite(values.reshape(len(values), -1)).all(1)
            counts[name] = int(bad.sum())
    if counts:
        named = ", ".join(
            f"column '{n}' holds NaN or infinite values in {c} of {rows} rows"
            for n, c in counts.items()
        )
        _log.warning(
            "feature_cols: %s (%s); their outputs are what the model computes for them "
            "(classification: prediction NaN where the logits are not finite); filter or "
            "fill them first",
            named,
            task,
        )


def _predicted(
    model, inputs, batch, output_cols, expected, classification, scalar_outputs, input_shapes
) -> pa.RecordBatch:
    """``batch`` with the model's outputs on ``inputs`` appended."""
    outputs = as_outputs(model(*inputs))
    if len(outputs) != expected:
        what = "classification" if classification else "output_cols"
        raise ValueError(
            f"{what}: the model returned {len(outputs)} outputs for output columns {output_cols}"
        )
    check_rows(outputs, output_cols, batch.num_rows, input_shapes)
    if classification:
        columns = class_columns(outputs[0])
    else:
        columns = [tensor_to_arrow(o, s) for o, s in zip(outputs, scalar_outputs)]
    return pa.RecordBatch.from_arrays(
        batch.columns + columns, names=batch.schema.names + output_cols
    )


def check_rows(
    outputs: list[torch.Tensor], names: list[str], rows: int, input_shapes: list[list[int]] | None
) -> None:
    """Each output must have one row per input row (its first dimension): the new columns
    sit beside the batch's rows."""
    for name, output in zip(names, outputs):
        if output.dim() == 0 or len(output) != rows:
            raise ValueError(
                f"input_shapes: the model's output '{name}' has shape {list(output.shape)} "
                f"for a batch of {rows} rows; transform needs one output row per input row "
                f"(the first dimension), so forward() must keep the rows of its inputs "
                f"(input_shapes: {input_shapes})"
            )


def class_columns(logits: torch.Tensor) -> list[pa.Array]:
    """Class logits of shape [B, C] (C >= 2) or [B] / [B, 1] (one binary logit z) as
    [raw, probability, prediction]: raw and probability are array<double> with C values
    (two for a binary logit), prediction the class index as a double.

    C logits: probability = softmax, prediction = argmax, raw = the logits less their row
    mean (softmax and argmax unchanged; with two classes raw[1] is half the log-odds, so
    BinaryClassificationEvaluator ranks rows correctly). One logit z: probability =
    [1 - sigmoid(z), sigmoid(z)], raw = [-z, z] and prediction = 1 where z > 0, as Spark's
    LogisticRegression writes them. A row whose logits are not all finite (NaN or infinite:
    from NaN or infinite features, or an overflow) gets prediction NaN, not a class; its raw
    and probability values are as computed.
    """
    z = logits.detach().to("cpu", torch.float64)
    if z.dim() == 2 and z.shape[1] == 1:
        z = z.squeeze(1)
    if z.dim() == 1:
        p = torch.sigmoid(z)
        raw, prob, pred = torch.stack([-z, z], 1), torch.stack([1 - p, p], 1), z > 0
    elif z.dim() == 2 and z.shape[1] >= 2:
        raw, prob, pred = z - z.mean(1, keepdim=True), torch.softmax(z, 1), z.argmax(1)
    else:
        raise ValueError(
            f"classification: the model's output has shape {list(logits.shape)}; class "
            "logits must be [B, C] with C >= 2 classes, or [B] or [B, 1] for one binary logit"
        )
    finite = torch.isfinite(z) if z.dim() == 1 else torch.isfinite(z).all(1)
    pred = torch.where(finite, pred.to(torch.float64), torch.nan)
    return [_double_rows(raw), _double_rows(prob), pa.array(pred.numpy())]


def _double_rows(values: torch.Tensor) -> pa.Array:
    """A [B, C] float64 tensor as an Arrow list<double> column of B rows."""
    rows, width = values.shape
    offsets = np.arange(0, (rows + 1) * width, width, dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.numpy().reshape(-1)))
