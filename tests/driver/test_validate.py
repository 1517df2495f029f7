import threading

import pytest
import torch
from pyspark.ml.linalg import VectorUDT
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
)

from spark_estimator.driver import validate
from spark_estimator.shared.spec import ColumnSpec

SCHEMA = StructType(
    [
        StructField("vec", VectorUDT()),
        StructField("arr", ArrayType(DoubleType())),
        StructField("num", FloatType()),
        StructField("cls", LongType()),
        StructField("cls_arr", ArrayType(IntegerType())),
        StructField("name", StringType()),
        StructField("tags", MapType(StringType(), DoubleType())),
        StructField("nested", StructType([StructField("a", DoubleType())])),
        StructField("is_val", BooleanType()),
        StructField("words", ArrayType(StringType())),
    ]
)


def test_supported_feature_and_label_types():
    features, labels = validate.check_columns(SCHEMA, ["vec", "arr", "num"], ["cls", "cls_arr"])
    assert [(c.kind, c.integral) for c in features] == [
        ("vector", False),
        ("array", False),
        ("scalar", False),
    ]
    assert [(c.kind, c.integral) for c in labels] == [("scalar", True), ("array", True)]
    assert [c.torch_dtype for c in labels] == [torch.int64, torch.int64]
    _, float_label = validate.check_columns(SCHEMA, ["vec"], ["num"])
    assert float_label[0].torch_dtype == torch.float32
    doubles, double_label = validate.check_columns(SCHEMA, ["vec", "arr"], ["num"], "float64")
    assert [c.dtype for c in doubles + double_label] == ["float64"] * 3


def test_missing_column_is_named():
    with pytest.raises(ValueError, match="feature_cols: column 'nope' is not in the DataFrame"):
        validate.check_columns(SCHEMA, ["nope"], ["cls"])
    with pytest.raises(ValueError, match="label_cols: column 'gone'"):
        validate.check_columns(SCHEMA, ["vec"], ["gone"])


@pytest.mark.parametrize("col", ["tags", "nested", "words", "is_val"])
def test_unsupported_feature_types_are_named(col):
    with pytest.raises(TypeError, match=f"feature_cols: column '{col}' has type"):
        validate.check_columns(SCHEMA, [col], ["cls"])


def test_strings_bytes_and_spark_images_are_variable_columns():
    image = StructType(
        [
            StructField("origin", StringType()),
            StructField("height", IntegerType()),
            StructField("width", IntegerType()),
            StructField("nChannels", IntegerType()),
            StructField("mode", IntegerType()),
            StructField("data", BinaryType()),
        ]
    )
    schema = StructType(
        [*SCHEMA.fields, StructField("img", image), StructField("raw", BinaryType())]
    )
    features, _ = validate.check_columns(schema, ["name", "img", "raw"], ["cls"])
    assert [(c.kind, c.variable) for c in features] == [
        ("string", True),
        ("image", True),
        ("binary", True),
    ]
    _, labels = validate.check_columns(schema, ["vec"], ["name"])
    assert labels[0].kind == "string"
    with pytest.raises(TypeError, match="label_cols: column 'raw' has type binary"):
        validate.check_columns(schema, ["vec"], ["raw"])


def test_vector_labels_are_float_vectors_like_vector_features():
    _, labels = validate.check_columns(SCHEMA, ["arr"], ["vec"])
    assert labels == [ColumnSpec("vec", "vector", "float32")]


def test_empty_duplicate_and_overlapping_columns():
    with pytest.raises(ValueError, match="feature_cols: at least one"):
        validate.check_columns(SCHEMA, [], ["cls"])
    with pytest.raises(ValueError, match="label_cols: at least one"):
        validate.check_columns(SCHEMA, ["vec"], [])
    with pytest.raises(ValueError, match="feature_cols: duplicate"):
        validate.check_columns(SCHEMA, ["vec", "vec"], ["cls"])
    with pytest.raises(ValueError, match="label_cols: .*also listed in feature_cols"):
        validate.check_columns(SCHEMA, ["num"], ["num"])


def test_validation_values():
    validate.check_validation(SCHEMA, None, [])
    validate.check_validation(SCHEMA, 0.2, [])
    validate.check_validation(SCHEMA, "is_val", ["vec"])
    validate.check_validation(SCHEMA, "cls", ["vec"])  # 0/1 integers
    for bad in (0.0, 1.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="validation: a fraction must be in"):
            validate.check_validation(SCHEMA, bad, [])
    with pytest.raises(ValueError, match="validation: column 'missing'"):
        validate.check_validation(SCHEMA, "missing", [])
    with pytest.raises(TypeError, match="validation: column 'num' has type float"):
        validate.check_validation(SCHEMA, "num", [])
    with pytest.raises(ValueError, match="validation: column 'is_val' is also"):
        validate.check_validation(SCHEMA, "is_val", ["is_val"])


def test_input_shapes():
    validate.check_input_shapes(None, ["a"])
    validate.check_input_shapes([[-1, 1, 8, 8]], ["a"])
    validate.check_input_shapes([[1, 8, 8]], ["a"])  # one row's shape, as Horovod's users write it
    with pytest.raises(ValueError, match="input_shapes: 2 shapes given for 1"):
        validate.check_input_shapes([[-1], [-1]], ["a"])
    for bad in ([], [-1, -1], [-1, 0], [-2, 4], [0], [3, -1]):
        with pytest.raises(ValueError, match="input_shapes: shape"):
            validate.check_input_shapes([bad], ["a"])
    scalar, array = ColumnSpec("a", "scalar", "float32"), ColumnSpec("b", "array", "float32")
    validate.check_input_shapes([[-1, 1], [-1, 3]], ["a", "b"], [scalar, array])
    with pytest.raises(ValueError, match=r"shape \[-1, 2\] has 2 elements per row, but column 'a'"):
        validate.check_input_shapes([[-1, 2], [-1, 3]], ["a", "b"], [scalar, array])
    validate.check_input_shapes([[1], [3]], ["a", "b"], [scalar, array])
    with pytest.raises(ValueError, match=r"shape \[2\] has 2 elements per row, but column 'a'"):
        validate.check_input_shapes([[2], [3]], ["a", "b"], [scalar, array])


def test_positive_numbers_and_slots():
    validate.check_positive("batch_size", 1)
    for bad in (0, -3, None):
        with pytest.raises(ValueError, match="batch_size: must be >= 1"):
            validate.check_positive("batch_size", bad)
    validate.check_positive("shuffle_buffer_size", None, optional=True)
    with pytest.raises(ValueError, match="train_steps_per_epoch: must be >= 1, got 0"):
        validate.check_positive("train_steps_per_epoch", 0, optional=True)
    # checked for both estimators with the fit's other params (keep_checkpoints is on TrainSpec)
    with pytest.raises(ValueError, match="keep_checkpoints: must be >= 1"):
        validate.check_positive("keep_checkpoints", 0, optional=True)
    with pytest.raises(ValueError, match=r"row_group_size_mb: must be > 0, got -0.5"):
        validate.check_positive("row_group_size_mb", -0.5)
    validate.check_num_proc(4, 4)
    with pytest.raises(ValueError, match="num_proc: must be >= 1"):
        validate.check_num_proc(0, 4)
    with pytest.raises(ValueError, match="num_proc: 5 training processes .* only 4 tasks"):
        validate.check_num_proc(5, 4)


def test_output_cols():
    validate.check_output_cols(None, ["a"])
    validate.check_output_cols(["p"], ["a"])
    with pytest.raises(ValueError, match="output_cols: \\['a'\\] already exist"):
        validate.check_output_cols(["a"], ["a"])
    with pytest.raises(ValueError, match="output_cols: must be distinct"):
        validate.check_output_cols(["p", "p"], [])


def test_choices_and_the_reader():
    validate.check_choice("dtype", "float64", ("float32", "float64"))
    with pytest.raises(ValueError, match=r"compression: must be one of \['snappy'\], got 'lzo'"):
        validate.check_choice("compression", "lzo", ("snappy",))
    validate.check_reader("reader", "arrow")
    with pytest.raises(ValueError, match="reader: must be one of"):
        validate.check_reader("reader", "parquet")


def test_transformation_fn_must_be_a_picklable_function():
    assert validate.check_transformation_fn(None) is None
    assert isinstance(validate.check_transformation_fn(lambda batch: batch), bytes)
    with pytest.raises(TypeError, match="transformation_fn: expected a function"):
        validate.check_transformation_fn("scale")
    lock = threading.Lock()
    with pytest.raises(TypeError, match="transformation_fn"):
        validate.check_transformation_fn(lambda batch: (lock, batch)[1])


class FakeConfSession:
    def __init__(self, settings):
        self.conf = type("Conf", (), {"get": lambda _, k, d=None: settings.get(k, d)})()


def test_dynamic_allocation_is_refused_up_front():
    validate.check_no_dynamic_allocation(FakeConfSession({}))
    validate.check_no_dynamic_allocation(
        FakeConfSession({"spark.dynamicAllocation.enabled": "false"})
    )
    with pytest.raises(ValueError, match="num_proc: training runs as a Spark barrier job"):
        validate.check_no_dynamic_allocation(
            FakeConfSession({"spark.dynamicAllocation.enabled": "true"})
        )


def test_the_real_session_has_no_dynamic_allocation(spark):
    validate.check_no_dynamic_allocation(spark)


TASK_GPUS, EXECUTOR_GPUS = "spark.task.resource.gpu.amount", "spark.executor.resource.gpu.amount"


@pytest.mark.parametrize(
    "conf, told",
    [
        ({}, False),  # no GPUs configured: the CPU, silently
        ({TASK_GPUS: "0"}, False),
        ({TASK_GPUS: "1", EXECUTOR_GPUS: "4"}, "auto"),  # a GPU each; warn where one got none
        ({EXECUTOR_GPUS: "4"}, "auto"),  # executors have GPUs, tasks ask for none: warned
    ],
)
def test_use_gpu_auto_asks_for_a_gpu_only_where_the_cluster_has_gpus_configured(conf, told):
    assert validate.tasks_use_gpu("auto", conf.get) == told


def test_use_gpu_false_is_the_cpu_anywhere():
    assert validate.tasks_use_gpu(False, {TASK_GPUS: "1"}.get) is False


def test_use_gpu_true_is_required_of_every_task_where_gpus_are_configured():
    assert validate.tasks_use_gpu(True, {TASK_GPUS: "0.5"}.get) is True


@pytest.mark.parametrize("conf", [{}, {EXECUTOR_GPUS: "4"}, {TASK_GPUS: "0"}])
def test_use_gpu_true_without_a_gpu_per_task_is_refused_naming_it(conf):
    with pytest.raises(ValueError, match=r"use_gpu: True .*spark.task.resource.gpu.amount"):
        validate.tasks_use_gpu(True, conf.get)


def test_gpu_decoding_needs_gpus_and_on_a_local_master_torchvision_here():
    validate.check_decode_device("cpu", False, "no GPU", local=True)  # nothing asked of the CPU
    with pytest.raises(ValueError, match=r"^decode_device: 'cuda' .* but there are none here; "):
        validate.check_decode_device("cuda", False, "there are none here", local=False)
    validate.check_decode_device("cuda", "auto", "", local=False)  # a cluster's own Python
    try:
        import torchvision.io  # noqa: F401

        pytest.skip("torchvision imports here")
    except Exception:
        pass
    with pytest.raises(
        ImportError, match=r"^decode_device: 'cuda' decodes JPEG images with torchvision"
    ):
        validate.check_decode_device("cuda", "auto", "", local=True)
