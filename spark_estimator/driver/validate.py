"""Driver: every check on the user's input that can run before a Spark job starts.

Each failure is a ValueError (bad value) or TypeError (bad type) whose message starts with
the parameter or column at fault. Nothing here touches the store or launches a job: the
schema comes from the DataFrame's analyzed plan.
"""

from __future__ import annotations

from collections.abc import Callable

from pyspark.ml.linalg import VectorUDT
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DataType,
    IntegralType,
    NumericType,
    StringType,
    StructType,
)

from ..shared.packages import require_gpu_jpeg, require_petastorm
from ..shared.serialization import dumps, pack_functions
from ..shared.spec import (
    BAD_ROWS,
    DECODE_DEVICES,
    DECODE_FUNCTIONS,
    DECODE_POOLS,
    IMAGE_FIELDS,
    READERS,
    ColumnSpec,
    DecodeSpec,
    column_param,
)
from .data_checks import check_shape_fits


def _numeric(dt: DataType) -> bool:
    return isinstance(dt, NumericType)


def column_spec(schema: StructType, name: str, role: str, dtype: str = "float32") -> ColumnSpec:
    """Check that column ``name`` exists with a type supported for ``role``: feature, label
    or sample_weight (a numeric scalar)."""
    param = column_param(role)
    if name not in schema.names:
        raise ValueError(
            f"{param}: column '{name}' is not in the DataFrame (columns: {schema.names})"
        )
    dt = schema[name].dataType
    if _numeric(dt):
        integral = role == "label" and isinstance(dt, IntegralType)
        return ColumnSpec(name, "scalar", "int64" if integral else dtype)
    if role != "sample_weight" and isinstance(dt, ArrayType) and _numeric(dt.elementType):
        integral = role == "label" and isinstance(dt.elementType, IntegralType)
        return ColumnSpec(name, "array", "int64" if integral else dtype)
    if role != "sample_weight" and isinstance(dt, VectorUDT):  # labels: e.g. one-hot
        return ColumnSpec(name, "vector", dtype)
    if role != "sample_weight" and isinstance(dt, StringType):  # text: decode_fn tokenizes
        return ColumnSpec(name, "string", dtype)
    if role == "feature" and isinstance(dt, BinaryType):  # encoded images, or other bytes
        return ColumnSpec(name, "binary", dtype)
    if role == "feature" and is_image_struct(dt):  # spark.read.format("image")'s column
        return ColumnSpec(name, "image", dtype)
    allowed = {
        "feature": "a numeric scalar, array<numeric>, an ML Vector, binary (encoded images), "
        "string, or Spark's image struct",
        "label": "a numeric scalar, array<numeric> (of any length), an ML Vector or string",
        "sample_weight": "a numeric scalar",
    }[role]
    raise TypeError(f"{param}: column '{name}' has type {dt.simpleString()}; it must be {allowed}")


def is_image_struct(dt: DataType) -> bool:
    """Whether ``dt`` is the struct of Spark's image source (``IMAGE_FIELDS``)."""
    return isinstance(dt, StructType) and set(dt.names) == set(IMAGE_FIELDS)


def sequence_element_integral(schema: StructType, name: str) -> bool:
    """Whether the array column ``name`` holds integers (token ids: int64 when ragged)."""
    dt = schema[name].dataType
    return isinstance(dt, ArrayType) and isinstance(dt.elementType, IntegralType)


def decode_spec(
    stage,
    features: list[ColumnSpec] | None,
    labels: list[ColumnSpec] | None,
    reader: str = "arrow",
    bad_rows: str = "fail",
    bucket_by_length: bool = False,
    string_labels: bool = True,
) -> DecodeSpec:
    """How the executors decode ``stage``'s variable columns (its ``DECODE_PARAMS``; a
    fit's ``bad_rows`` and ``bucket_by_length``), checked with the columns they apply to
    (``check_decoding``; ``string_labels``: whether the trainer takes a label column of
    strings as it is)."""
    functions = {name: stage.getOrDefault(name) for name in DECODE_FUNCTIONS}
    padding, workers, device, pool, timeout = (
        stage.getPaddingValue(),
        stage.getDecodeWorkers(),
        stage.getDecodeDevice(),
        stage.getDecodePool(),
        stage.getDecodeTimeout(),
    )
    check_positive("decode_timeout", timeout, optional=True)
    check_decoding(
        features, labels, reader, functions, padding, workers, device, pool, bad_rows, string_labels
    )
    return DecodeSpec(
        functions=pack_functions(**functions),
        padding_value=float(padding),
        pool=pool,
        workers=workers,
        bad_rows=bad_rows,
        device=device,
        bucket_by_length=bucket_by_length,
        timeout=timeout,
    )


def check_decoding(
    features: list[ColumnSpec] | None,
    labels: list[ColumnSpec] | None,
    reader: str,
    functions: dict,
    padding_value: float,
    decode_workers: int | None,
    decode_device: str,
    decode_pool: str = "auto",
    bad_rows: str = "fail",
    string_labels: bool = True,
) -> None:
    """The decoding params (``functions``: each of ``DECODE_FUNCTIONS``, or None), and what
    variable columns need: a string feature a decode step (it would reach forward() as a
    list of Python strings), a string label one too unless ``string_labels`` (a
    LightningModule may take strings; our loop's loss cannot), the Arrow reader, decode_fn
    or decode_batch_fn, not both, and no decode_fn with decode_device='cuda' (the images
    are still bytes after it)."""
    for name, fn in functions.items():
        if fn is not None and not callable(fn):
            raise TypeError(f"{name}: expected a function, got {type(fn).__name__}")
        if fn is not None:
            dumps(fn, name)
    check_choice("bad_rows", bad_rows, BAD_ROWS)
    check_choice("decode_device", decode_device, DECODE_DEVICES)
    check_choice("decode_pool", decode_pool, DECODE_POOLS)
    if decode_workers is not None:
        check_positive("decode_workers", decode_workers)
    if not isinstance(padding_value, (int, float)):
        raise TypeError(f"padding_value: expected a number, got {padding_value!r}")
    decode_fn, batch_fn = functions.get("decode_fn"), functions.get("decode_batch_fn")
    if decode_fn is not None and batch_fn is not None:
        raise ValueError(
            "decode_batch_fn: is the batch form of decode_fn; give one of them, not both"
        )
    if batch_fn is not None and functions.get("collate_fn") is not None:
        raise ValueError(
            "collate_fn: decode_batch_fn returns the batch's tensors itself; give no collate_fn "
            "with it"
        )
    variable = [c for c in (features or []) + (labels or []) if c.variable]
    if not variable:
        return
    if reader != "arrow":
        raise ValueError(
            f"reader: {reader!r} reads numeric columns only; column '{variable[0].name}' is "
            f"{variable[0].kind}: use reader='arrow'"
        )
    decoded = decode_fn is not None or batch_fn is not None
    strings = [c.name for c in features or [] if c.kind == "string"]
    if strings and not decoded and functions.get("collate_fn") is None:
        name = strings[0]
        raise ValueError(
            f"decode_fn: feature column '{name}' holds strings, which would reach forward() "
            "as a list of Python strings. Categories: index them first with "
            f"pyspark.ml.feature.StringIndexer(inputCol='{name}', outputCol='{name}_index'), "
            f"then OneHotEncoder(inputCols=['{name}_index'], outputCols=['{name}_onehot']) "
            f"for one-hot vectors, and train on feature_cols=['{name}_onehot'] (or the "
            "index, for an embedding). Text: give decode_fn that turns each row's text into "
            "token ids, e.g. lambda row, augment: {'" + name + "': torch.tensor("
            "tokenizer.encode(row['" + name + "']).ids)} (or decode_batch_fn, or a "
            "collate_fn)"
        )
    string_label = [c.name for c in labels or [] if c.kind == "string"]
    if string_label and not string_labels and not decoded and functions.get("collate_fn") is None:
        name = string_label[0]
        raise ValueError(
            f"label_cols: column '{name}' holds strings, which the loss cannot take; index "
            f"them first with pyspark.ml.feature.StringIndexer(inputCol='{name}', "
            f"outputCol='{name}_index') and train on label_cols=['{name}_index'] (transform's "
            "prediction is then that index), or give a decode_fn that maps each row's "
            f"string to a number: lambda row, augment: {{..., '{name}': "
            f"torch.tensor(classes[row['{name}']])}}"
        )
    if decode_device == "cuda" and decode_fn is not None:
        raise ValueError(
            "decode_device: 'cuda' decodes the encoded images of a batch on the GPU, after "
            "the rows' decoding, so it cannot be combined with a decode_fn; augment on the "
            "GPU with decode_batch_fn instead (it gets the decoded batch there), or decode on "
            "the CPU"
        )


def check_decode_device(decode_device: str, gpus: bool | str, none_why: str, local: bool) -> None:
    """``decode_device='cuda'`` decodes on each process's GPU: refused where the tasks get
    none (``gpus``: ``tasks_use_gpu``'s answer, False for none; ``none_why`` says why), and
    on a local master, whose tasks run the driver's Python, where torchvision's GPU
    decoder does not import (``require_gpu_jpeg``)."""
    if decode_device != "cuda":
        return
    if gpus is False:
        raise ValueError(
            "decode_device: 'cuda' decodes JPEG images on the GPU of each process, but "
            f"{none_why}; use decode_device='cpu'"
        )
    if local:
        require_gpu_jpeg()


def check_bucketing(bucket_by_length: bool, columns: list[ColumnSpec] | None, shuffle: bool):
    """``bucket_by_length`` regroups the rows of the shuffle buffer by length, so it needs
    ``shuffle`` and a feature or label column whose rows can differ in length: a string or
    an array (whether an array column's lengths vary is known once it is written; one whose
    rows all have one length leaves the order as shuffled). ``columns`` None: not known yet
    (``fit_on_parquet`` checks them once the Parquet is described)."""
    if not bucket_by_length:
        return
    if not shuffle:
        raise ValueError(
            "bucket_by_length: groups the rows of the shuffle buffer by length, so it needs "
            "shuffle=True; set bucket_by_length=False to read the rows in order"
        )
    if columns is not None and not any(c.kind in ("string", "array", "sequence") for c in columns):
        kinds = ", ".join(f"'{c.name}' ({c.kind})" for c in columns)
        raise ValueError(
            "bucket_by_length: groups rows by the length of their sequences or strings, but "
            f"no feature or label column is an array or a string (columns: {kinds}); "
            "set bucket_by_length=False"
        )


def as_class_indices(spec: ColumnSpec) -> ColumnSpec:
    """A scalar label column read as class indices: loaded as int64 whatever its numeric
    type (StringIndexer's labels are doubles); its values must be whole numbers, which the
    materialization's write checks (``check_observed``)."""
    if spec.kind == "scalar" and not spec.integral:
        return ColumnSpec(spec.name, "scalar", "int64")
    return spec


def check_sample_weight_col(
    schema: StructType | None, name: str | None, used_cols: list[str], dtype: str
) -> ColumnSpec | None:
    """The weight column's spec (None without a schema, for fit_on_parquet)."""
    if name is None:
        return None
    if name in used_cols:
        raise ValueError(f"sample_weight_col: column '{name}' is also a feature or label")
    return column_spec(schema, name, "sample_weight", dtype) if schema is not None else None


def check_column_names(feature_cols: list[str], label_cols: list[str]) -> None:
    if not feature_cols:
        raise ValueError("feature_cols: at least one feature column is required")
    if not label_cols:
        raise ValueError("label_cols: at least one label column is required")
    overlap = set(feature_cols) & set(label_cols)
    if overlap:
        raise ValueError(f"label_cols: {sorted(overlap)} also listed in feature_cols")
    for param, cols in (("feature_cols", feature_cols), ("label_cols", label_cols)):
        if len(set(cols)) != len(cols):
            raise ValueError(f"{param}: duplicate column names in {cols}")


def check_columns(
    schema: StructType, feature_cols: list[str], label_cols: list[str], dtype: str = "float32"
) -> tuple[list[ColumnSpec], list[ColumnSpec]]:
    check_column_names(feature_cols, label_cols)
    features = [column_spec(schema, c, "feature", dtype) for c in feature_cols]
    labels = [column_spec(schema, c, "label", dtype) for c in label_cols]
    return features, labels


def check_validation(schema: StructType, validation, used_cols: list[str]) -> None:
    if validation is None:
        return
    if isinstance(validation, str):
        if validation not in schema.names:
            raise ValueError(
                f"validation: column '{validation}' is not in the DataFrame "
                f"(columns: {schema.names})"
            )
        if validation in used_cols:
            raise ValueError(f"validation: column '{validation}' is also a feature or label")
        dt = schema[validation].dataType
        if not isinstance(dt, (BooleanType, IntegralType)):
            raise TypeError(
                f"validation: column '{validation}' has type {dt.simpleString()}; "
                "a validation column must be boolean or 0/1 integers"
            )
        return
    if not 0.0 < validation < 1.0:
        raise ValueError(f"validation: a fraction must be in (0, 1), got {validation}")


def check_input_shapes(
    input_shapes, feature_cols: list[str], features: list[ColumnSpec] | None = None
) -> None:
    """One shape per feature column, each ``[-1, d1, ...]`` (-1 first, the batch dimension:
    any other place would mix rows) or one row's shape ``[d1, ...]``, sizes positive (see
    ``shared.shapes``). With the columns' specs, a scalar column's shape must hold one
    value per row (array lengths are known only once the data is read:
    ``data_checks.check_row_lengths``)."""
    if input_shapes is None:
        return
    if len(input_shapes) != len(feature_cols):
        raise ValueError(
            f"input_shapes: {len(input_shapes)} shapes given for {len(feature_cols)} "
            f"feature columns {feature_cols}"
        )
    for col, shape in zip(feature_cols, input_shapes):
        if not shape or any(d < 1 for d in shape[1 if shape[0] == -1 else 0 :]):
            raise ValueError(
                f"input_shapes: shape {shape} for column '{col}' must be one row's shape, "
                "positive sizes (e.g. [1, 8, 8]), or the batch's: -1 first, the rows, then "
                "the row's sizes ([-1, 1, 8, 8])"
            )
    for spec, shape in zip(features or [], input_shapes):
        if spec.kind == "scalar":
            check_shape_fits(shape, spec.name, 1)


def check_positive(name: str, value, optional: bool = False) -> None:
    if optional and value is None:
        return
    if value is None or value <= 0:
        bound = "> 0" if isinstance(value, float) else ">= 1"
        raise ValueError(f"{name}: must be {bound}, got {value}")


def check_non_negative(name: str, value) -> None:
    if value is None or value < 0:
        raise ValueError(f"{name}: must be >= 0, got {value}")


def check_fraction(name: str, value) -> None:
    """A fraction in [0, 1]."""
    if not 0 <= value <= 1:
        raise ValueError(f"{name}: must be a fraction from 0 to 1, got {value}")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}: must be one of {list(choices)}, got {value!r}")


def check_reader(name: str, reader: str) -> None:
    """The reader exists and, for petastorm, imports here (the executors share the stack)."""
    check_choice(name, reader, READERS)
    if reader == "petastorm":
        require_petastorm()


def check_transformation_fn(fn) -> bytes | None:
    """None, or the cloudpickled function."""
    if fn is None:
        return None
    if not callable(fn):
        raise TypeError(f"transformation_fn: expected a function, got {type(fn).__name__}")
    return dumps(fn, "transformation_fn")


def check_min_num_proc(
    min_num_proc: int | None, num_proc: int, slots: int, slots_of: str | None = None
) -> int:
    """The number of processes an elastic fit starts with: as many of ``num_proc`` as the
    cluster's ``slots`` allow, at least ``min_num_proc``; ``num_proc`` itself when the fit
    is not elastic (``min_num_proc`` None). ``slots_of`` as for ``check_num_proc``."""
    if min_num_proc is None:
        return num_proc
    if min_num_proc > num_proc:
        raise ValueError(
            f"min_num_proc: {min_num_proc} is more than num_proc={num_proc}; an elastic fit "
            "runs between min_num_proc and num_proc processes"
        )
    check_num_proc(min_num_proc, slots, name="min_num_proc", slots_of=slots_of)
    return min(num_proc, slots)


def check_num_proc(
    num_proc: int,
    slots: int,
    waited: str = "",
    name: str = "num_proc",
    slots_of: str | None = None,
) -> None:
    """``num_proc`` against the cluster's ``slots``; ``waited`` says how long the slots were
    waited for (e.g. "start_timeout=30 s"), for the message; ``slots_of`` what a slot is
    when they are GPU slots of a task resource profile (``TaskProfile.slots_note``)."""
    check_positive(name, num_proc)
    if num_proc <= slots:
        return
    within = f" (counted within {waited})" if waited else ""
    if slots_of:
        raise ValueError(
            f"{name}: {num_proc} training processes requested but the cluster has only "
            f"{slots} GPU slots{within}: {slots_of}; a barrier job needs all of them at the "
            f"same time. Lower {name}, add executors with a GPU, or set "
            "stage_level_scheduling=False to run the training tasks with the cluster's own "
            "task resources (spark.task.cpus, spark.task.resource.gpu.amount)"
        )
    raise ValueError(
        f"{name}: {num_proc} training processes requested but the cluster can run only "
        f"{slots} tasks at once{within}; a barrier job needs all of them at the same time. "
        "Lower num_proc or add executor cores."
    )


GPU_AMOUNTS = ("spark.task.resource.gpu.amount", "spark.executor.resource.gpu.amount")


def tasks_use_gpu(use_gpu: bool | str, conf: Callable[[str], str | None], stage=None) -> bool | str:
    """What the tasks are told of ``use_gpu``, given the cluster's settings (``conf(key)``:
    a value or None) and the job's task resources (``stage``, a
    ``stage_profile.TaskProfile``; None: the cluster's own): ``"auto"`` where GPUs are
    configured (per task or per executor; a task that gets none warns), False where none
    are (the CPU, silently); True only where every task gets a GPU
    (``spark.task.resource.gpu.amount`` > 0, or a profile of one), else a ValueError that
    says, where the cluster has GPUs, why stage-level scheduling gives the tasks none."""

    def amount(key: str) -> float:
        try:
            return float(conf(key) or 0)
        except ValueError:
            return 0.0

    profiled = stage is not None and stage.profile is not None
    if use_gpu is True and amount(GPU_AMOUNTS[0]) <= 0 and not profiled:
        why = getattr(stage, "reason", None)
        raise ValueError(
            "use_gpu: True requires a GPU for every task, but Spark gives tasks none: "
            "spark.task.resource.gpu.amount is not set (see docs/gpu.md)"
            + (
                f", and stage-level scheduling, which would give the training tasks one, does "
                f"not apply here: {why}"
                if why
                else ""
            )
            + ". Set it on a GPU cluster, or leave use_gpu at 'auto' (the default) to train "
            "on the CPU where there is no GPU"
        )
    if use_gpu == "auto":
        return "auto" if any(amount(key) > 0 for key in GPU_AMOUNTS) else False
    return use_gpu


def check_use_gpu(spark, use_gpu: bool | str, stage=None) -> bool | str:
    """``tasks_use_gpu`` with ``spark``'s settings; raises before any job."""

    def conf(key: str) -> str | None:
        try:
            return spark.conf.get(key, None)
        except Exception:  # a session that cannot tell
            return None

    return tasks_use_gpu(use_gpu, conf, stage)


def check_no_dynamic_allocation(spark) -> None:
    """Barrier jobs need a fixed set of executors; Spark refuses them otherwise, late."""
    try:
        enabled = spark.conf.get("spark.dynamicAllocation.enabled", "false")
    except Exception:  # a session that cannot tell
        return
    if str(enabled).lower() == "true":
        raise ValueError(
            "num_proc: training runs as a Spark barrier job, which cannot run with "
            "spark.dynamicAllocation.enabled=true; disable dynamic allocation for this "
            "application"
        )


def check_output_cols(output_cols, existing: list[str]) -> None:
    if output_cols is None:
        return
    if not output_cols or len(set(output_cols)) != len(output_cols):
        raise ValueError(f"output_cols: must be distinct non-empty names, got {output_cols}")
    clash = [c for c in output_cols if c in existing]
    if clash:
        raise ValueError(f"output_cols: {clash} already exist in the DataFrame")


def classification_cols(
    output_cols, probability_col: str, raw_prediction_col: str, label_cols=None
) -> list[str]:
    """The columns ``classification`` adds in transform: [rawPredictionCol, probabilityCol,
    prediction column], checked to be distinct; it reads one model output (one label)."""
    if output_cols is not None and len(output_cols) != 1:
        raise ValueError(
            f"classification: reads the model's single output into one prediction column, "
            f"but output_cols names {len(output_cols)}: {output_cols}"
        )
    if label_cols is not None and len(label_cols) != 1:
        raise ValueError(
            f"classification: needs one label column of class indices, got {label_cols}"
        )
    names = [raw_prediction_col, probability_col, output_cols[0] if output_cols else "prediction"]
    if len(set(names)) != 3 or not all(names):
        raise ValueError(
            "classification: rawPredictionCol, probabilityCol and the prediction column "
            f"(output_cols) must be distinct non-empty names, got {names}"
        )
    return names


def check_class_output_shapes(output_shapes) -> None:
    """With ``classification``, the model has one output: [B, C] with C >= 2, or [B] or
    [B, 1] (one binary logit); ``output_shapes`` leave out B (None: not known)."""
    if output_shapes is None:
        return
    if len(output_shapes) != 1:
        raise ValueError(
            f"classification: the model has {len(output_shapes)} outputs; it must return "
            "one tensor of class logits"
        )
    shape = list(output_shapes[0])
    if shape in ([], [1]) or (len(shape) == 1 and shape[0] >= 2):
        return
    raise ValueError(
        f"classification: the model's output has shape {['B', *shape]}; class logits must "
        "be [B, C] with C >= 2 classes, or [B] or [B, 1] for one binary logit"
    )
