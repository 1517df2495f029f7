"""A TorchModel's MLflow ``python_function``: ``predict(pandas.DataFrame)`` returns the
columns ``transform`` appends for those rows, computed by the same code (``TorchModel``'s
``_prediction`` and ``predict_with`` of transform's tasks, decoding included).

The feature columns are turned into Arrow columns of the types the fit read them as
(numbers as doubles, arrays and ML vectors as lists of doubles, token-id sequences as
lists of longs, images as bytes, text as strings: ``driver.mlflow_model.kind_type``), or,
for a TorchModel not made by a fit, of the types pandas holds; a ``path`` column, as
``binaryFile`` has, names the rows that fail to decode. The rows then run through the
model in batches of ``BATCH_ROWS`` (transform's Arrow batches), under ``torch.no_grad``, on
``predict_device``: in a Spark task (``mlflow.pyfunc.spark_udf``) the GPU Spark assigned
it, else this process's GPU where torch has one, else the CPU. One ``predict`` runs at a
time per loaded model (requests of a server wait for each other).

Outputs come back as a pandas DataFrame with one row per input row, in order: a double
column per output of shape [] or [1], else a column of float32 numpy arrays; with
``classification``, ``rawPrediction`` and ``probability`` as float64 numpy arrays (Spark's
ML vectors in ``transform``) and ``prediction`` as a double.
"""

from __future__ import annotations

import base64
import threading

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
from .worker.predict import predict_device, predict_with

BATCH_ROWS = 10_000  # spark.sql.execution.arrow.maxRecordsPerBatch's default, as transform


class TorchPyfunc:
    """What ``mlflow.pyfunc.load_model`` gives for a logged TorchModel (wrapped in MLflow's
    ``PyFuncModel``); ``get_raw_model()`` is the TorchModel."""

    def __init__(self, model: TorchModel):
        self.model = model
        self._lock = threading.Lock()
        self._device: torch.device | None = None

    def get_raw_model(self) -> TorchModel:
        return self.model

    def predict(self, model_input: pd.DataFrame) -> pd.DataFrame:
        """The columns ``transform`` appends for the rows of ``model_input`` (see the
        module).

        Raises MlflowException (INVALID_PARAMETER_VALUE: a server answers 400 with its
        message) for a missing or mistyped feature column, naming it, and for an image or
        string that does not decode, naming the column (and the row's ``path``): the
        ValueError or TypeError of transform's checks and decoding, as its cause."""
        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        try:
            return self._predict(frame)
        except (ValueError, TypeError) as e:
            raise MlflowException(str(e), error_code=INVALID_PARAMETER_VALUE) from e

    def _predict(self, frame: pd.DataFrame) -> pd.DataFrame:
        batch = arrow_batch(frame, self.model)
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
            parts = (batch.slice(start, BATCH_ROWS) for start in range(0, len(frame), BATCH_ROWS))
            done = list(predict_with(module, device, "predict", parts, **options))
        if not done:
            return pd.DataFrame({f.name: pd.Series(dtype=object) for f in fields})
        return pa.Table.from_batches(done).select(names).to_pandas()

    def _module_on(self, device: torch.device) -> torch.nn.Module:
        module = self.model.getModel()
        if device != self._device:
            module.to(device).eval()
            self._device = device
        return module


def _stacked(name: str, values: pd.Series, arrow_type: pa.ListType) -> pa.Array | None:
    """A column of 1-D numpy arrays of one length (what Spark hands a pandas UDF, and
    MLflow's schema check leaves) as one list array, stacked at once; None for any other
    column (lists, arrays of several lengths), which ``pa.array`` converts."""
    cells = values.to_numpy()
    if not len(cells) or not isinstance(cells[0], np.ndarray):
        return None
    try:
        stacked = np.stack(cells)
    except (ValueError, TypeError):  # of several lengths
        return None
    if stacked.ndim != 2 or stacked.dtype == object:
        return None
    width = stacked.shape[1]
    offsets = pa.array(np.arange(0, (len(stacked) + 1) * width, width, dtype=np.int32))
    try:
        flat = pa.array(stacked.reshape(-1)).cast(arrow_type.value_type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise TypeError(
            f"feature_cols: column '{name}' ({stacked.dtype} arrays) cannot be read as the "
            f"model's input of type {arrow_type}: {e}"
        ) from e
    return pa.ListArray.from_arrays(offsets, flat)


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


def arrow_batch(frame: pd.DataFrame, model: TorchModel) -> pa.RecordBatch:
    """The feature columns of ``frame`` (and its ``path`` column, naming rows in decoding
    errors) as Arrow, each of the type the fit read it as where it is known."""
    names = list(model.getFeatureCols()) if model.isDefined("feature_cols") else []
    missing = [n for n in names if n not in frame.columns]
    if missing:
        raise ValueError(
            f"feature_cols: column '{missing[0]}' is not in the DataFrame "
            f"(columns: {list(frame.columns)})"
        )
    if ROW_NAMES in frame.columns and ROW_NAMES not in names:
        names.append(ROW_NAMES)
    schema = fit_schema(model)
    known = {f.name: f.dataType for f in schema.fields} if schema is not None else {}
    arrays = [_arrow_column(n, frame[n], known.get(n)) for n in names]
    return pa.RecordBatch.from_arrays(arrays, names=names)


def _arrow_column(name: str, values: pd.Series, dt: DataType | None) -> pa.Array:
    """``values`` as Arrow, of Spark type ``dt`` where given (ML vectors as their values,
    an image struct's ``data`` given as a string as base64: MLflow's JSON decodes only the
    bytes of binary columns); a TypeError naming the column where they are not of it."""
    if isinstance(dt, ArrayType):
        stacked = _stacked(name, values, to_arrow_type(dt))
        if stacked is not None:
            return stacked
        values = values.map(lambda v: v.toArray() if hasattr(v, "toArray") else v)
    if isinstance(dt, StructType):
        values = values.map(_image_bytes)
    if isinstance(dt, BinaryType):
        kinds = {type(v).__name__ for v in values if not isinstance(v, (bytes, bytearray))}
        if kinds - {"NoneType"}:
            raise TypeError(
                f"feature_cols: column '{name}' must hold bytes (encoded images, as "
                f"binaryFile's content), not {sorted(kinds)}"
            )
    arrow_type = None if dt is None else to_arrow_type(dt)
    if arrow_type is not None and len(values) == 0:
        return pa.array([], type=arrow_type)
    try:
        return pa.array(values, type=arrow_type, from_pandas=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, TypeError, ValueError) as e:
        want = "" if dt is None else f" of type {dt.simpleString()}"
        raise TypeError(
            f"feature_cols: column '{name}' ({values.dtype}) cannot be read as "
            f"the model's input{want}: {e}"
        ) from e
