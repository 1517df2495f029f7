"""Executor: whole Arrow columns to tensors and back, without per-row Python loops.

Used by the training loader (Parquet row groups) and by transform (Arrow batches from
mapInArrow, where ML vectors arrive as their struct encoding).
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from ...shared.shapes import batch_shape
from ...shared.spec import IMAGE_FIELDS, ColumnSpec
from .binary_rows import BinaryRows

Tensors = dict[str, torch.Tensor]  # a batch's columns as the loaders hand them over


def chunk_rows(chunk: dict) -> int:
    """Rows of a chunk or batch (a dict of equally long columns)."""
    return len(next(iter(chunk.values())))


@contextmanager
def read_only_arrays():
    """Silence torch's warning on read-only arrays: Arrow's memory is only ever read from."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        yield


def scalar_groups(tensors: Tensors, columns: list[ColumnSpec]) -> dict[torch.dtype, list[str]]:
    """The names of ``columns`` (ColumnSpecs) holding one value per row in ``tensors``, by
    the dtype they have there: each group travels and is held as one ``[columns, rows]``
    block."""
    groups: dict[torch.dtype, list[str]] = {}
    for c in columns:
        if c.kind == "scalar" and tensors[c.name].dim() == 1:
            groups.setdefault(tensors[c.name].dtype, []).append(c.name)
    return groups


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``: on a GPU through pinned memory, without making
    the host wait for the device."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def as_tensor(array: np.ndarray | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A zero-copy view of a reader's array, in ``dtype`` (inside ``read_only_arrays``)."""
    if not isinstance(array, torch.Tensor):
        array = torch.from_numpy(array)
    return array.to(dtype)


def _combine(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(column, pa.ChunkedArray):
        return column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    return column


def _fixed_length(name: str, lengths: np.ndarray) -> int:
    if len(lengths) == 0:
        return 0
    lo, hi = int(lengths.min()), int(lengths.max())
    if lo != hi:
        raise ValueError(
            f"column '{name}': arrays have varying lengths ({lo} to {hi}); every row of an "
            "array or vector column must have the same length"
        )
    return lo


def _list_to_numpy(name: str, arr: pa.ListArray) -> np.ndarray:
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
    width = _fixed_length(name, lengths)
    values = arr.flatten()
    if values.null_count:
        raise ValueError(f"column '{name}': arrays contain null elements")
    return values.to_numpy(zero_copy_only=False).reshape(len(arr), width)


def _vector_to_numpy(name: str, arr: pa.StructArray, dtype: np.dtype | None) -> np.ndarray:
    """Decode pyspark.ml's vector struct (type 0 sparse, 1 dense) into a dense 2-d array of
    ``dtype`` (None: the values' own, float64), each value converted once from its double."""
    n = len(arr)
    kind = arr.field("type").to_numpy(zero_copy_only=False)
    values = arr.field("values")
    value_lengths = pc.list_value_length(values).to_numpy(zero_copy_only=False)
    sizes = np.where(kind == 1, value_lengths, arr.field("size").fill_null(0).to_numpy())
    width = _fixed_length(name, sizes)
    if dtype is None:
        dtype = values.type.value_type.to_pandas_dtype()
    out = np.zeros((n, width), dtype=dtype)
    dense = np.flatnonzero(kind == 1)
    if len(dense):
        flat = pc.list_flatten(values.take(pa.array(dense))).to_numpy(zero_copy_only=False)
        out[dense] = flat.reshape(len(dense), width)
    sparse = np.flatnonzero(kind == 0)
    if len(sparse):
        idx_lists = arr.field("indices").take(pa.array(sparse))
        counts = pc.list_value_length(idx_lists).to_numpy(zero_copy_only=False)
        rows = np.repeat(sparse, counts)
        cols = pc.list_flatten(idx_lists).to_numpy(zero_copy_only=False)
        vals = pc.list_flatten(values.take(pa.array(sparse))).to_numpy(zero_copy_only=False)
        out[rows, cols] = vals
    return out


def numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    """NumPy's dtype for ``dtype`` (None where NumPy has none, as for bfloat16)."""
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        return None


def column_to_numpy(
    name: str, column: pa.Array | pa.ChunkedArray, dtype: np.dtype | None = None, when="fit"
) -> np.ndarray:
    """A column as one array: scalars and lists in Arrow's dtype (zero-copy where Arrow
    allows), ML vectors decoded into ``dtype`` (None: float64, their values' dtype); nulls
    refused, saying to drop them before ``when`` (fit or transform)."""
    arr = _combine(column)
    _refuse_nulls(name, arr, when)
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        return _list_to_numpy(name, arr)
    if pa.types.is_struct(arr.type):
        return _vector_to_numpy(name, arr, dtype)
    return arr.to_numpy(zero_copy_only=False)


def _refuse_nulls(name: str, arr: pa.Array, when: str) -> None:
    if arr.null_count:
        raise ValueError(
            f"column '{name}': {arr.null_count} null values; drop or fill them before {when} "
            f"(df.na.drop(subset=['{name}']))"
        )


def variable_to_numpy(
    spec: ColumnSpec, column: pa.Array | pa.ChunkedArray, when: str = "fit"
) -> np.ndarray:
    """A variable column's rows as a NumPy array of Python objects, one per row, for the
    per-row decoding (``Decoder``): bytes (binary), str (string), a 1-D array
    (sequence, in the column's dtype) or a dict of Spark's image fields (image); nulls
    refused as ``column_to_numpy`` does."""
    arr = _combine(column)
    _refuse_nulls(spec.name, arr, when)
    out = np.empty(len(arr), dtype=object)
    if spec.kind == "sequence":
        offsets = arr.offsets.to_numpy(zero_copy_only=False) - arr.offsets[0].as_py()
        values = arr.flatten().to_numpy(zero_copy_only=False)
        values = values.astype(numpy_dtype(spec.torch_dtype), copy=False)
        out[:] = np.split(values, offsets[1:-1]) if len(arr) else []
    elif spec.kind == "image":
        fields = {name: arr.field(name).to_pylist() for name in IMAGE_FIELDS}
        out[:] = [dict(zip(IMAGE_FIELDS, row)) for row in zip(*fields.values())]
    else:
        out[:] = arr.to_pylist()
    return out


def variable_rows(
    spec: ColumnSpec, column: pa.Array | pa.ChunkedArray, when: str = "fit"
) -> np.ndarray | BinaryRows:
    """A variable column's rows for the loader: a binary or string column's as
    ``BinaryRows`` (its Arrow memory, no object a row), any other as ``variable_to_numpy``
    makes them."""
    arr = _combine(column)
    if spec.kind not in BINARY_ROWS or not _binary_layout(arr.type):
        return variable_to_numpy(spec, arr, when)
    _refuse_nulls(spec.name, arr, when)
    return BinaryRows.from_arrow(arr)


BINARY_ROWS = ("binary", "string")  # the kinds whose rows ``variable_rows`` keeps in Arrow


def _binary_layout(kind: pa.DataType) -> bool:
    return any(
        check(kind)
        for check in (
            pa.types.is_binary,
            pa.types.is_large_binary,
            pa.types.is_string,
            pa.types.is_large_string,
        )
    )


def object_bytes(values: np.ndarray | BinaryRows) -> int:
    """About the bytes of a variable column's rows (``variable_rows``')."""
    if isinstance(values, BinaryRows):
        return values.nbytes
    total = 0
    for value in values:
        if isinstance(value, dict):
            value = value.get("data") or b""
        total += value.nbytes if isinstance(value, np.ndarray) else len(value)
    return total


def class_indices(name: str, values: np.ndarray) -> np.ndarray:
    """Float labels (StringIndexer's doubles) as int64 class indices; a ValueError naming
    the column where one is not a whole number."""
    whole = np.isfinite(values) & (np.floor(values) == values)
    if not whole.all():
        bad = values[~whole][:3].tolist()
        raise ValueError(
            f"column '{name}': class indices must be whole numbers, got {bad}; with "
            "classification=True or a class-index loss (CrossEntropyLoss, NLLLoss) labels are "
            "class indices 0..k-1"
        )
    return values.astype(np.int64)


def column_to_tensor(name: str, column, dtype: torch.dtype, when: str = "fit") -> torch.Tensor:
    np_dtype = numpy_dtype(dtype)
    array = column_to_numpy(name, column, np_dtype, when)
    # Arrow's buffers are read-only; torch needs writable memory, so copy only if required
    tensor = torch.from_numpy(np.require(array, dtype=np_dtype, requirements=["C", "W"]))
    return tensor.to(dtype)


def reshape_input(name: str, tensor: torch.Tensor, shape: list[int] | None) -> torch.Tensor:
    """Apply a column's ``input_shapes`` entry (either form, ``shared.shapes``) to a batch."""
    if shape is None:
        return tensor
    return tensor.reshape(batch_shape(shape, math.prod(tensor.shape[1:]), name))


def tensor_to_arrow(output: torch.Tensor, as_scalar: bool) -> pa.Array:
    """One model output of shape [B, ...] as a double column or an array<float> column."""
    out = output.detach().to("cpu")
    if as_scalar:
        return pa.array(out.reshape(len(out)).to(torch.float64).numpy())
    flat = out.reshape(len(out), -1).to(torch.float32).numpy()
    width = flat.shape[1]
    offsets = np.arange(0, (len(flat) + 1) * width, width, dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.reshape(-1)))
