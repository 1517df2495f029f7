"""A TorchModel's MLflow ``python_function``: ``predict(pandas.DataFrame)`` returns the
columns ``transform`` appends for those rows, computed by the same code (``TorchModel``'s
``_prediction`` and ``predict_with`` of transform's tasks, decoding included).

The feature columns (of a pandas DataFrame, or of the dict of numpy arrays that MLflow's
check of a tensor signature hands on) are turned into Arrow columns of the types the fit
read them as (numbers as doubles, arrays and ML vectors as lists of doubles, token-id
sequences as lists of longs, images as bytes, text as strings:
``driver.mlflow_model.kind_type``), or, for a TorchModel not made by a fit, of the types
pandas holds; a ``path`` column, as ``binaryFile`` has, names the rows that fail to decode.
A binary column's base64 text is decoded here (``binary_values``): MLflow's server decodes
it in the ``dataframe_split`` and ``dataframe_records`` forms of a request but hands the
``inputs`` and ``instances`` forms' text on as ASCII bytes. NaN and infinite numbers are
kept as such (not read as nulls), as ``transform`` reads them (``worker.predict``).
The rows then run through the model in batches of ``BATCH_ROWS`` (transform's Arrow
batches), under ``torch.no_grad``, on ``predict_device``: in a Spark task
(``mlflow.pyfunc.spark_udf``) the GPU Spark assigned it, else this process's GPU where
torch has one, else the CPU. One ``predict`` runs at a time per loaded model (requests of a
server wait for each other).

Outputs come back as a pandas DataFrame with one row per input row, in order: a double
column per output of shape [] or [1], else a column of float32 numpy arrays; with
``classification``, ``rawPrediction`` and ``probability`` as float64 numpy arrays (Spark's
ML vectors in ``transform``) and ``prediction`` as a double. With the param
``output_array`` (``OUTPUT_ARRAY``: a list of output column names), one 2-D float64 numpy
array instead, a row per input row holding those columns' values in the order named
(``rows_array``): the form ``mlflow.pyfunc.spark_udf(..., result_type="array<double>")``
converts a batch at once, where it converts each array value of a struct of columns on its
own (docs/serving.md).
"""

from __future__ import annotations

import base64
import binascii
import math
import threading
from collections.abc import Mapping

import numpy as np
import pandas as pd
import pyarrow as pa
import torch
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_type
from pyspark.sql.types import ArrayType, BinaryType, DataType, StructType

from .driver.mlflow_model import fit_schema
from .model import TorchModel
from .shared.spec import ROW_NAMES
from .worker.decode.decoded import BadRow
from .worker.predict import predict_device, predict_with

BATCH_ROWS = 10_000  # spark.sql.execution.arrow.maxRecordsPerBatch's default, as transform
OUTPUT_ARRAY = "output_array"  # predict's param: output columns as one array a row


class TorchPyfunc:
    """What ``mlflow.pyfunc.load_model`` gives for a logged TorchModel (wrapped in MLflow's
    ``PyFuncModel``); ``get_raw_model()`` is the TorchModel."""

    def __init__(self, model: TorchModel):
        self.model = model
        self._lock = threading.Lock()
        self._device: torch.device | None = None

    def get_raw_model(self) -> TorchModel:
        return self.model

    def predict(
        self,
        model_input: pd.DataFrame | Mapping[str, np.ndarray],
        params: dict | None = None,
    ) -> pd.DataFrame | np.ndarray:
        """The columns ``transform`` appends for the rows of ``model_input`` (see the
        module): a pandas DataFrame, or a dict of numpy arrays with the rows first (what
        MLflow's check of a tensor signature hands on). ``params``: ``{"output_array":
        [names]}`` gives those output columns' values as one float64 array a row instead
        (a 2-D numpy array, ``rows_array``); an empty list (the signature's default), the
        DataFrame. An ``output_array`` that names no output column is refused as below.

        Raises MlflowException (INVALID_PARAMETER_VALUE: a server answers 400 with its
        message) for a missing or mistyped feature column, naming it, and for an image or
        string that does not decode, naming the column (and the row's ``path``; for a
        binary column, what to send): the ValueError or TypeError of transform's checks
        and decoding, as its cause."""
        try:
            wanted = _output_array(params)
            table = self._predict(input_columns(model_input))
            return table.to_pandas() if wanted is None else rows_array(table, wanted)
        except BadRow as e:
            message = f"{e}; {binary_hint(self.model)}".rstrip("; ")
            raise MlflowException(message, error_code=INVALID_PARAMETER_VALUE) from e
        except (ValueError, TypeError) as e:
            raise MlflowException(str(e), error_code=INVALID_PARAMETER_VALUE) from e

    def _predict(self, columns: dict[str, pd.Series | np.ndarray]) -> pa.Table:
        batch = arrow_batch(columns, self.model)
        fields, options = self.model._prediction(from_arrow_schema(batch.schema))
        names = options["output_cols"]
        with self._lock:
            device = predict_device(_task_context())
            if (
                options["decode"].device == "cuda"
                and device.type != "cuda"
                and any(c.variable for c in options["features"])
            ):
                raise ValueError(
                    "decode_device: 'cuda', but predict runs on the CPU here (no GPU); "
                    "model.setDecodeDevice('cpu') before logging the model decodes on the CPU"
                )
            module = self._module_on(device)
            rows = range(0, batch.num_rows, BATCH_ROWS)
            parts = (batch.slice(start, BATCH_ROWS) for start in rows)
            done = list(predict_with(module, device, "predict", parts, **options))
        if not done:  # no rows: columns of no type, as pandas makes of no values
            return pa.table({f.name: pa.array([], type=pa.null()) for f in fields})
        return pa.Table.from_batches(done).select(names)

    def _module_on(self, device: torch.device) -> torch.nn.Module:
        module = self.model.getModel()
        if device != self._device:
            module.to(device).eval()
            self._device = device
        return module


def _output_array(params: dict | None) -> list[str] | None:
    """The output columns the ``output_array`` param names (None: not given, or empty)."""
    wanted = (params or {}).get(OUTPUT_ARRAY)
    if wanted is None or (not isinstance(wanted, str) and len(wanted) == 0):
        return None
    if isinstance(wanted, str) or not all(isinstance(n, str) for n in wanted):
        raise ValueError(
            f"{OUTPUT_ARRAY}: a list of output column names, e.g. ['probability'] "
            f"(given: {wanted!r})"
        )
    return list(wanted)


def rows_array(table: pa.Table, names: list[str]) -> np.ndarray:
    """The columns ``names`` of ``table`` as one float64 array of a row per table row:
    each double column's value, each array column's values, side by side in that order;
    each column converted from its Arrow buffers at once, never a row at a time."""
    unknown = [n for n in names if n not in table.column_names]
    if unknown:
        raise ValueError(
            f"{OUTPUT_ARRAY}: {unknown} are not output columns of this model (its output "
            f"columns: {table.column_names})"
        )
    parts = []
    for name in names:
        column = table.column(name).combine_chunks()
        if not pa.types.is_list(column.type):
            parts.append(column.to_numpy(zero_copy_only=False).reshape(len(column), 1))
            continue
        offsets = column.offsets.to_numpy()
        widths = np.diff(offsets)
        if len(widths) and (widths != widths[0]).any():
            raise ValueError(
                f"{OUTPUT_ARRAY}: column '{name}' holds arrays of several lengths "
                f"({sorted(set(widths.tolist()))[:5]}); one array a row needs one length"
            )
        values = column.values.slice(offsets[0], offsets[-1] - offsets[0])
        width = int(widths[0]) if len(widths) else 0
        parts.append(values.to_numpy(zero_copy_only=False).reshape(len(column), width))
    return np.concatenate([p.astype(np.float64, copy=False) for p in parts], axis=1)


def input_columns(model_input) -> dict[str, pd.Series | np.ndarray]:
    """``model_input``'s columns by name: a DataFrame's (or what pandas makes of other
    input) as Series; a dict's values as given where they are numpy arrays of rows of
    values (2-D or more: a tensor signature's), else as Series."""
    if isinstance(model_input, Mapping):
        return {
            name: value if isinstance(value, np.ndarray) and value.ndim > 1 else pd.Series(value)
            for name, value in model_input.items()
        }
    frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
    return {name: frame[name] for name in frame.columns}


def _stacked(values: pd.Series) -> np.ndarray | None:
    """A column of 1-D numpy arrays of one length (what Spark hands a pandas UDF, and
    MLflow's check of an array column leaves) stacked at once into rows; None for any
    other column (lists, arrays of several lengths), which ``pa.array`` converts."""
    cells = values.to_numpy()
    if not len(cells) or not isinstance(cells[0], np.ndarray):
        return None
    try:
        stacked = np.stack(cells)
    except (ValueError, TypeError):  # of several lengths
        return None
    return stacked if stacked.ndim == 2 and stacked.dtype != object else None


def _list_array(name: str, rows: np.ndarray, arrow_type: pa.ListType | None) -> pa.Array:
    """The rows of a numpy array (each row's values flattened) as one list array of
    ``arrow_type`` (of their own element type where None), without a copy per row."""
    width = math.prod(rows.shape[1:])
    flat = rows.reshape(len(rows), width)
    offsets = pa.array(np.arange(0, (len(flat) + 1) * width, width, dtype=np.int32))
    values = pa.array(flat.reshape(-1))
    if arrow_type is not None:
        try:
            values = values.cast(arrow_type.value_type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise TypeError(
                f"feature_cols: column '{name}' ({rows.dtype} arrays) cannot be read as the "
                f"model's input of type {arrow_type}: {e}"
            ) from e
    return pa.ListArray.from_arrays(offsets, values)


def binary_columns(model: TorchModel) -> list[str]:
    """The model's feature columns that the fit read as bytes."""
    schema = fit_schema(model)
    if schema is None:
        return []
    return [f.name for f in schema.fields if isinstance(f.dataType, BinaryType)]


def binary_hint(model: TorchModel) -> str:
    """What a request must hold in each binary feature column of ``model`` (empty where it
    has none)."""
    given = [
        n
        for n in ("decode_fn", "decode_batch_fn")
        if model.isDefined(n) and model.getOrDefault(n) is not None
    ]
    if given:
        what = f"the bytes its {given[0]} reads"
    else:
        what = "an image file's bytes (PNG, JPEG, ...: binaryFile's content)"
    return "; ".join(
        f"column '{name}' expects {what}, as bytes in Python and base64-encoded in JSON"
        for name in binary_columns(model)
    )


def binary_values(name: str, values: pd.Series, hint: str) -> pd.Series:
    """A binary column's values as bytes: base64 text decoded, given as ``str`` (refused,
    with ``hint``, where it is not base64) or as bytes of base64's characters alone (the
    ``inputs`` and ``instances`` forms of a request: MLflow turns their JSON text into
    ASCII bytes; an image file's bytes are never all such characters); other bytes kept as
    they are. A TypeError naming the column for values of another type."""
    kinds = {
        type(v).__name__
        for v in values
        if not isinstance(v, (bytes, bytearray, str)) and v is not None
    }
    if kinds:
        raise TypeError(
            f"feature_cols: column '{name}' must hold bytes (encoded images, as "
            f"binaryFile's content), not {sorted(kinds)}; {hint}"
        )
    out = []
    for row, value in enumerate(values):
        if isinstance(value, str):
            decoded = _base64(value.encode("utf-8"))
            if decoded is None:
                raise TypeError(
                    f"feature_cols: column '{name}': row {row} is text that is not base64 "
                    f"({value[:20]!r}); {hint}"
                )
            value = decoded
        elif value is not None:
            value = _base64(bytes(value)) or bytes(value)
        out.append(value)
    return pd.Series(out, index=values.index, dtype=object)


def _base64(text: bytes) -> bytes | None:
    """``text`` decoded from base64 where it is base64 (its alphabet, padded to a multiple
    of 4; line breaks allowed), else None."""
    if not text:
        return None
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        if b"\n" not in text:
            return None
    try:
        return base64.b64decode(text.replace(b"\r", b"").replace(b"\n", b""), validate=True)
    except (binascii.Error, ValueError):
        return None


def _image_bytes(image):
    """A Spark image struct (a dict or Row) with its ``data`` as bytes."""
    if image is None:
        return None
    fields = image.asDict() if hasattr(image, "asDict") else dict(image)
    if isinstance(fields.get("data"), str):
        fields["data"] = base64.b64decode(fields["data"])
    return fields


def _task_context():
    from pyspark import TaskContext

    return TaskContext.get()


def arrow_batch(columns: dict[str, pd.Series | np.ndarray], model: TorchModel) -> pa.RecordBatch:
    """The feature columns of ``columns`` (and its ``path`` column, naming rows in decoding
    errors) as Arrow, each of the type the fit read it as where it is known."""
    names = list(model.getFeatureCols()) if model.isDefined("feature_cols") else []
    missing = [n for n in names if n not in columns]
    if missing:
        raise ValueError(
            f"feature_cols: column '{missing[0]}' is not in the DataFrame "
            f"(columns: {list(columns)})"
        )
    if ROW_NAMES in columns and ROW_NAMES not in names:
        names.append(ROW_NAMES)
    schema = fit_schema(model)
    known = {f.name: f.dataType for f in schema.fields} if schema is not None else {}
    hint = binary_hint(model)
    arrays = [_arrow_column(n, columns[n], known.get(n), hint) for n in names]
    return pa.RecordBatch.from_arrays(arrays, names=names)


def _arrow_column(
    name: str, values: pd.Series | np.ndarray, dt: DataType | None, hint: str
) -> pa.Array:
    """``values`` (a Series, or a numpy array of rows of values) as Arrow, of Spark type
    ``dt`` where given (ML vectors as their values, a binary column's base64 text decoded
    (``binary_values``, saying ``hint`` where it cannot be), an image struct's ``data``
    given as a string as base64: MLflow's JSON decodes only the bytes of binary columns);
    a TypeError naming the column where they are not of it."""
    arrow_type = None if dt is None else to_arrow_type(dt)
    if isinstance(values, np.ndarray):  # rows of values
        if dt is None or isinstance(dt, ArrayType):
            return _list_array(name, values, arrow_type)
        values = pd.Series(list(values))  # refused below: not of one value a row
    if isinstance(dt, ArrayType):
        stacked = _stacked(values)
        if stacked is not None:
            return _list_array(name, stacked, arrow_type)
        values = values.map(lambda v: v.toArray() if hasattr(v, "toArray") else v)
    if isinstance(dt, StructType):
        values = values.map(_image_bytes)
    if isinstance(dt, BinaryType):
        values = binary_values(name, values, hint)
    if arrow_type is not None and len(values) == 0:
        return pa.array([], type=arrow_type)
    # NaN is a number here, as in transform, not a null: numbers and arrays keep it
    numbers = values.dtype.kind == "f" or isinstance(dt, ArrayType)
    try:
        return pa.array(values, type=arrow_type, from_pandas=not numbers)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, TypeError, ValueError) as e:
        want = "" if dt is None else f" of type {dt.simpleString()}"
        raise TypeError(
            f"feature_cols: column '{name}' ({values.dtype}) cannot be read as "
            f"the model's input{want}: {e}"
        ) from e
