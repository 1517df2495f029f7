"""Executor: batched inference for TorchModel.transform, one Arrow batch at a time.

The model is unpickled once per task and run under ``torch.no_grad()`` on whole Arrow
batches (``spark.sql.execution.arrow.maxRecordsPerBatch`` rows each), on the GPU Spark
assigned the task if any, else on CPU. Input columns pass through untouched.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import torch

from ..serialization import loads
from ..spec import ColumnSpec
from .convert import column_to_tensor, reshape_input, tensor_to_arrow
from .rendezvous import task_device
from .train import as_outputs


def predict_batches(
    batches: Iterator[pa.RecordBatch],
    model_bytes: bytes,
    features: list[ColumnSpec],
    input_shapes: list[list[int]] | None,
    output_cols: list[str],
    scalar_outputs: list[bool],
) -> Iterator[pa.RecordBatch]:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    device = task_device(ctx, use_gpu=True, warn=False)[0] if ctx else torch.device("cpu")
    model = loads(model_bytes).to(device).eval()
    shapes = input_shapes or [None] * len(features)
    with torch.no_grad():
        for batch in batches:
            if batch.num_rows == 0:
                continue
            inputs = [
                reshape_input(
                    c.name, column_to_tensor(c.name, batch.column(c.name), c.torch_dtype), s
                ).to(device)
                for c, s in zip(features, shapes)
            ]
            outputs = as_outputs(model(*inputs))
            if len(outputs) != len(output_cols):
                raise ValueError(
                    f"output_cols: the model returned {len(outputs)} outputs for output "
                    f"columns {output_cols}"
                )
            columns = [tensor_to_arrow(o, s) for o, s in zip(outputs, scalar_outputs)]
            yield pa.RecordBatch.from_arrays(
                batch.columns + columns, names=batch.schema.names + output_cols
            )
