"""Driver: a fitted TorchModel written as an MLflow Model (``spark_estimator.mlflow``'s
``save_model`` and ``log_model``, and ``mlflow_logging`` after a fit).

The model's folder is the Spark ML stage ``TorchModel.save`` writes (``metadata/``,
``objects.pkl``, ``weights.pt``) with MLflow's files beside it::

    MLmodel                  flavors: python_function (loader_module spark_estimator.mlflow),
                             spark_estimator, pytorch (with pytorch_flavor=True); signature
    requirements.txt, python_env.yaml, conda.yaml     the pip requirements
    input_example.json, serving_input_example.json    where an example was given or found
    data/                    pytorch_flavor=True only: MLflow's pickle of the whole module
    code/                    the user's own modules the pickle needs (``mlflow_code``) and
                             ``code_paths``: first on sys.path when MLflow loads the model

so ``TorchModel.load`` reads the folder MLflow downloads, as it read the folders that
``mlflow_logging`` logged before (the stage alone, no MLmodel). The signature comes from the
columns the fit read (``feature_kinds``, ``feature_lengths``), else from the input example's
columns, and the outputs ``transform`` appends (``TorchModel._prediction``). Its inputs are
tensors (``tensor_inputs``) where every feature column is a number, an array or a vector of
known width, not all numbers: MLflow checks those a column at once. Else they are columns:
numbers as ``double``, arrays and vectors as arrays of ``double`` (token-id sequences of
``long``), images as ``binary``, strings as ``string``, Spark's image struct as an object.
Outputs are columns: ``double`` or arrays of ``float`` (``double`` for the classifier
columns); its one param, ``output_array`` (``params_schema``), asks ``predict`` for chosen
output columns as one array a row instead.
"""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
import sys
import tempfile
from importlib import metadata as importlib_metadata
from typing import Any

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DataType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from ..shared.shapes import row_length
from ..shared.spec import ROW_NAMES, ColumnSpec
from . import mlflow_code
from .persistence import OBJECTS_FILE

log = logging.getLogger(__name__)

FLAVOR = "spark_estimator"  # our flavor's name in MLmodel
LOADER_MODULE = "spark_estimator.mlflow"  # python_function's loader (its _load_pyfunc)
EXAMPLE_ROWS = 2  # rows of the input example taken from a DataFrame or a fit's dataset
# what predict needs besides this package: pinned to the versions installed here
REQUIRED = ("torch", "pyspark", "pandas", "pyarrow", "numpy", "cloudpickle", "fsspec")
IMAGE_REQUIRED = ("Pillow", "simplejpeg")  # spark_estimator.decoding's, for images
# Spark's image source's struct (``shared.spec.IMAGE_FIELDS``), as its reader reads it
IMAGE_STRUCT = StructType(
    [
        StructField("origin", StringType(), True),
        StructField("height", IntegerType(), True),
        StructField("width", IntegerType(), True),
        StructField("nChannels", IntegerType(), True),
        StructField("mode", IntegerType(), True),
        StructField("data", BinaryType(), True),
    ]
)


def torch_model_of(model: Any):
    """The TorchModel ``model`` is or holds: a TorchModel, or a tuning result whose
    ``bestModel`` is one (CrossValidatorModel, TrainValidationSplitModel)."""
    for candidate in (model, getattr(model, "bestModel", None)):
        if hasattr(candidate, "_prediction") and hasattr(candidate, "getModel"):
            return candidate
    raise TypeError(
        f"model: a {type(model).__name__} is no TorchModel and holds none as its bestModel; "
        "log the fitted TorchModel (what TorchEstimator.fit returns)"
    )


def kind_type(spec: ColumnSpec) -> DataType:
    """The Spark type a feature column of ``spec``'s kind is read from in ``predict``."""
    if spec.kind == "sequence":
        return ArrayType(LongType() if spec.integral else DoubleType())
    return {
        "scalar": DoubleType(),
        "array": ArrayType(DoubleType()),
        "vector": ArrayType(DoubleType()),
        "binary": BinaryType(),
        "string": StringType(),
        "image": IMAGE_STRUCT,
    }[spec.kind]


def fit_schema(model) -> StructType | None:
    """The feature columns as the fit read them (None for a TorchModel not made by a fit,
    which does not record them)."""
    kinds = model._feature_kinds
    if not model.isDefined("feature_cols") or not kinds:
        return None
    names = model.getFeatureCols()
    if any(name not in kinds for name in names):
        return None
    return StructType([StructField(n, kind_type(ColumnSpec(n, *kinds[n])), True) for n in names])


def example_frame(example, feature_cols: list[str]):
    """An input example as pandas: a pandas DataFrame's feature columns, or the first
    ``EXAMPLE_ROWS`` rows of a Spark DataFrame's (classic or Connect), ML vectors as
    arrays."""
    import pandas as pd

    if example is None:
        return None
    if not isinstance(example, pd.DataFrame) and not hasattr(example, "sparkSession"):
        raise TypeError(
            f"input_example: a {type(example).__name__}; give a pandas or Spark DataFrame"
        )
    names = list(example.columns)
    missing = [c for c in feature_cols if c not in names]
    if missing:
        raise ValueError(
            f"input_example: the feature columns {missing} are not in it (columns: {names})"
        )
    if isinstance(example, pd.DataFrame):
        return example[feature_cols].head(EXAMPLE_ROWS)
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F

    schema = example.schema
    columns = [
        vector_to_array(F.col(f"`{c}`")).alias(c)
        if isinstance(schema[c].dataType, VectorUDT)
        else F.col(f"`{c}`")
        for c in feature_cols
    ]
    return example.select(*columns).limit(EXAMPLE_ROWS).toPandas()


def example_rows(store, data, feature_cols: list[str]):
    """The first ``EXAMPLE_ROWS`` rows of a fit's dataset (its train split, else its
    validation rows) as pandas, read from the Parquet in the store (no Spark job); None
    where a column is stored otherwise than ``predict`` takes it (an ML vector of a table
    read in place) or nothing could be read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = [f for split in ("train", "validation") for f in data.files.get(split, [])]
    first = next((path for path, groups in files if sum(groups)), None)
    if first is None:
        return None
    try:
        with store.fs.open(posixpath.join(data.path, first), "rb") as f:
            parquet = pq.ParquetFile(f)
            batch = next(parquet.iter_batches(batch_size=EXAMPLE_ROWS, columns=feature_cols))
    except (OSError, ValueError, StopIteration) as e:
        log.info("mlflow_logging: no input example (%s: %s)", type(e).__name__, e)
        return None
    kinds = {c.name: c.kind for c in data.features}
    vectors = [n for n in feature_cols if kinds.get(n) == "vector"]
    if any(pa.types.is_struct(batch.schema.field(n).type) for n in vectors):
        log.info("mlflow_logging: no input example (ML vector columns %s read in place)", vectors)
        return None
    return batch.to_pandas()


def mlflow_type(dt: DataType):
    """MLflow's type of a Spark column ``predict`` takes or returns."""
    from mlflow.types.schema import Array, Object, Property

    if isinstance(dt, ArrayType):
        return Array(mlflow_type(dt.elementType))
    if isinstance(dt, StructType):
        return Object([Property(f.name, mlflow_type(f.dataType), False) for f in dt.fields])
    names = {
        DoubleType: "double",
        FloatType: "float",
        LongType: "long",
        IntegerType: "integer",
        BinaryType: "binary",
        StringType: "string",
    }
    return names[type(dt)]


def infer_signature(model, example=None):
    """The model's signature: its feature columns (as the fit read them, else as the
    example holds them; with images or text, an optional ``path`` column too, which names
    the rows that fail to decode, as binaryFile's does in ``transform``) and the columns
    ``predict`` returns; None where neither tells the features' types."""
    import pyarrow as pa
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, Schema
    from pyspark.sql.pandas.types import from_arrow_schema

    schema = fit_schema(model)
    if schema is None and example is not None:
        try:
            table = pa.Table.from_pandas(example, preserve_index=False)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise TypeError(f"input_example: its columns' types are not known ({e})") from e
        schema = from_arrow_schema(table.schema)
    if schema is None:
        return None
    fields, options = model._prediction(schema)
    features = options["features"]
    inputs = tensor_inputs(model, features, example)
    if inputs is None:
        inputs = [ColSpec(mlflow_type(kind_type(c)), c.name) for c in features]
    if any(c.variable for c in features) and ROW_NAMES not in model.getFeatureCols():
        inputs.append(ColSpec("string", ROW_NAMES, required=False))  # names rows in errors
    outputs = [ColSpec(mlflow_type(f.dataType), f.name) for f in fields]
    return ModelSignature(inputs=Schema(inputs), outputs=Schema(outputs), params=params_schema())


def params_schema():
    """The params ``predict`` takes: ``output_array``, the output columns to give as one
    float64 array a row (``spark_estimator.pyfunc.rows_array``), none by default."""
    from mlflow.types.schema import ParamSchema, ParamSpec

    return ParamSchema([ParamSpec("output_array", "string", [], (-1,))])


def tensor_inputs(model, features: list[ColumnSpec], example=None) -> list | None:
    """A tensor signature's inputs where every feature column is a number, an array or an
    ML vector, not all numbers, and each array's width is known (``row_width``): one named
    ``TensorSpec`` a column, of the features' dtype, of shape (-1,) for numbers and
    (-1, width) for the others. MLflow checks these a column at once (and the widths),
    where it checks each row of an array of a column signature on its own, which costs
    more than an MLP's inference. None for any other model: a column signature."""
    import numpy as np
    from mlflow.types.schema import TensorSpec

    kinds = {c.kind for c in features}
    if not kinds & {"array", "vector"} or kinds - {"scalar", "array", "vector"}:
        return None
    shapes = model.getInputShapes() or [None] * len(features)
    inputs = []
    for column, shape in zip(features, shapes):
        width = None if column.kind == "scalar" else row_width(model, column, shape, example)
        if column.kind != "scalar" and width is None:
            return None
        dims = (-1,) if width is None else (-1, width)
        inputs.append(TensorSpec(np.dtype(column.dtype), dims, column.name))
    return inputs


def row_width(model, column: ColumnSpec, shape: list[int] | None, example=None) -> int | None:
    """How many values each row of the array or vector ``column`` holds: as the fit read
    them (``feature_lengths``), else as its ``input_shapes`` entry says, else as the input
    example's first row holds; None where none tells."""
    if column.name in model._feature_lengths:
        return int(model._feature_lengths[column.name])
    if shape is not None:
        return row_length(shape)
    if example is None or not len(example) or column.name not in example.columns:
        return None
    first = example[column.name].iloc[0]
    values = first.toArray() if hasattr(first, "toArray") else first
    return len(values) if hasattr(values, "__len__") else None


def default_requirements(model) -> list[str]:
    """This package, torch and what predict imports, at the versions installed here (a
    local version label such as torch's ``+cpu`` left out); Pillow and simplejpeg where
    images are decoded (by default, or by a decode_fn with ``spark_estimator.decoding``'s
    helpers). Other imports of a ``decode_fn`` are not known: ``extra_pip_requirements``
    names them."""
    names = ["spark-estimator", *REQUIRED]
    if {"binary", "image"} & {kind for kind, _ in model._feature_kinds.values()}:
        names += IMAGE_REQUIRED
    versions = {name: installed_version(name) for name in names}
    return [f"{n}=={v.split('+')[0]}" if v else n for n, v in versions.items()]


def save_model(
    path: str,
    mlflow_model=None,
    *,
    torch_model,
    signature=None,
    input_example=None,
    pip_requirements: list[str] | None = None,
    extra_pip_requirements: list[str] | None = None,
    pytorch_flavor: bool = False,
    metadata: dict | None = None,
    code_paths: list[str] | None = None,
) -> None:
    """Write ``torch_model`` (a TorchModel) at ``path`` as an MLflow Model (see the
    module); MLflow's ``Model.log`` calls this with the ``mlflow_model`` it logs."""
    import mlflow
    from mlflow.models import Model

    code_paths = checked_code_paths(code_paths)
    mlflow_model = mlflow_model if mlflow_model is not None else Model()
    if metadata:
        mlflow_model.metadata = metadata
    example = example_frame(input_example, torch_model.getFeatureCols())
    if signature is None:
        signature = infer_signature(torch_model, example)
    if pip_requirements is not None and extra_pip_requirements is not None:
        raise ValueError(
            "pip_requirements, extra_pip_requirements: give one of them, the whole list or "
            "what to add to the one inferred"
        )
    requirements = pip_requirements
    if requirements is None:
        requirements = [*default_requirements(torch_model), *(extra_pip_requirements or [])]
    with tempfile.TemporaryDirectory() as scratch:
        stage = os.path.join(scratch, "stage")
        torch_model.save(stage)
        mlflow_model.add_flavor(
            FLAVOR,
            spark_estimator_version=installed_version("spark-estimator"),
            stage_class=f"{type(torch_model).__module__}.{type(torch_model).__name__}",
        )
        module_dir = None
        if pytorch_flavor:
            module_dir = _pytorch_flavor(mlflow_model, torch_model.getModel(), scratch)
        shipped = [*code_paths, *own_code(stage, os.path.join(scratch, "code"), code_paths)]
        mlflow.pyfunc.save_model(
            path,
            loader_module=LOADER_MODULE,
            mlflow_model=mlflow_model,
            signature=signature,
            input_example=example,
            pip_requirements=requirements,
            code_paths=shipped or None,
        )
        for name in os.listdir(stage):
            shutil.move(os.path.join(stage, name), os.path.join(path, name))
        if module_dir is not None:
            shutil.move(module_dir, os.path.join(path, os.path.basename(module_dir)))
    mlflow_model.model_size_bytes = sum(
        os.path.getsize(os.path.join(folder, name))
        for folder, _, names in os.walk(path)
        for name in names
    )
    mlflow_model.save(os.path.join(path, "MLmodel"))


def checked_code_paths(code_paths, param: str = "code_paths") -> list[str]:
    """``code_paths`` as a list of existing files and folders; a ValueError or TypeError
    naming the parameter ``param`` for anything else."""
    if code_paths is None:
        return []
    if isinstance(code_paths, (str, bytes)) or not all(isinstance(p, str) for p in code_paths):
        raise TypeError(
            f"{param}: a list of paths of files or folders, e.g. ['src/mypkg'] "
            f"(given: {code_paths!r})"
        )
    missing = [p for p in code_paths if not os.path.exists(p)]
    if missing:
        raise ValueError(f"{param}: {missing} do not exist (from {os.getcwd()})")
    names = [os.path.basename(os.path.abspath(p)) for p in code_paths]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(
            f"{param}: several paths named {twice}; each is copied into the model's code/ "
            "folder by its name"
        )
    return list(code_paths)


def own_code(stage: str, folder: str, code_paths: list[str]) -> list[str]:
    """The user's own modules that the saved ``stage``'s pickle needs
    (``mlflow_code``), written into ``folder``; those of a top-level name that one of
    ``code_paths`` ships left out. Logged at INFO."""
    given = {os.path.basename(os.path.abspath(p)) for p in code_paths}
    found = mlflow_code.inferred_code_paths(os.path.join(stage, OBJECTS_FILE), folder)
    found = [p for p in found if os.path.basename(p) not in given]
    if found:
        log.info(
            "the model's own modules, shipped in its code/ folder: %s",
            [os.path.basename(p) for p in found],
        )
    return found


def _pytorch_flavor(mlflow_model, module, scratch: str) -> str:
    """MLflow's own pytorch flavor of ``module`` in its pickle format (the whole module,
    given back by ``mlflow.pytorch.load_model``), written by ``mlflow.pytorch.save_model``
    and added to ``mlflow_model``; the folder of its files. Not MLflow's ``pt2`` format, a
    graph traced with ``torch.export`` from example tensors: it gives back no module of the
    user's class and takes no images or text decoded on the way."""
    import inspect

    import mlflow.pytorch
    from mlflow.models import Model

    saved = os.path.join(scratch, "pytorch")
    options = {"pip_requirements": []}
    if "serialization_format" in inspect.signature(mlflow.pytorch.save_model).parameters:
        options["serialization_format"] = "pickle"  # pt2 is the default from MLflow 3.x on
    mlflow.pytorch.save_model(module, saved, **options)
    conf = Model.load(os.path.join(saved, "MLmodel")).flavors["pytorch"]
    conf.pop("code", None)
    mlflow_model.add_flavor("pytorch", **conf)
    return os.path.join(saved, conf["model_data"])


def add_code_to_path(path: str) -> None:
    """Put the ``code/`` folder of the MLflow Model at ``path`` (where its python_function
    has one) first on ``sys.path``, as ``mlflow.pyfunc.load_model`` does before loading."""
    from mlflow.models import Model

    mlmodel = os.path.join(path, "MLmodel")
    if not os.path.isfile(mlmodel):  # a stage that mlflow_logging logged before MLmodel
        return
    code = Model.load(mlmodel).flavors.get("python_function", {}).get("code")
    folder = os.path.join(path, code) if code else None
    if folder and os.path.isdir(folder) and folder not in sys.path:
        sys.path.insert(0, folder)


def installed_version(name: str) -> str | None:
    """The version of the distribution ``name`` installed here (None: not installed)."""
    try:
        return importlib_metadata.version(name)
    except importlib_metadata.PackageNotFoundError:
        return None


def log_model(model, name: str, registered_model_name: str | None = None, **options) -> Any:
    """``save_model`` through MLflow's ``Model.log``: a logged model of the active run (or
    of a new one), registered as ``registered_model_name`` when given; its ModelInfo."""
    from mlflow.models import Model

    return Model.log(
        None,  # artifact_path: MLflow 3 names models instead
        name=name,
        flavor=sys.modules[__name__],
        flavor_name=FLAVOR,
        registered_model_name=registered_model_name,
        torch_model=torch_model_of(model),
        **options,
    )
