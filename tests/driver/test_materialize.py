import json
import posixpath
import subprocess
import sys
import textwrap
import threading
import uuid
from dataclasses import asdict, replace

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.ml.linalg import Vectors
from pyspark.sql import functions as F

from spark_estimator.driver import materialize as materialize_module
from spark_estimator.driver.cache_key import cache_key, source_fingerprint
from spark_estimator.driver.materialize import WriteOptions
from spark_estimator.driver.materialize import materialize as _materialize
from spark_estimator.driver.validate import check_columns, check_sample_weight_col
from spark_estimator.store import DatasetFolder
from tests.conftest import LOCAL, spark_session, stop_session

pytestmark = pytest.mark.legacy  # materialization also runs on pyspark 3.5

OPTIONS = WriteOptions(num_files=2, row_group_bytes=32 * 2**20, compression="snappy")


def specs(df, features, labels, dtype="float32"):
    return check_columns(df.schema, features, labels, dtype)


def materialize(df, store, features, labels, validation, seed, options=OPTIONS):
    return _materialize(df, store, features, labels, validation, seed, options)


def key(df, features, labels, validation=None, seed=0, options=OPTIONS):
    cols = sum(specs(df, features, labels), [])
    return cache_key(source_fingerprint(df), cols, validation, seed, asdict(options))


def read_split(data, split):
    tables = [pq.read_table(posixpath.join(data.path, rel)) for rel, _ in data.files.get(split, [])]
    return [row for t in tables for row in t.to_pylist()]


def test_vectors_become_float_arrays_and_labels_keep_class_indices(spark, store):
    df = spark.createDataFrame(
        [(Vectors.dense([1.0, 2.0]), 3), (Vectors.sparse(2, [1], [5.0]), 1)], ["v", "y"]
    )
    data = materialize(df, store, *specs(df, ["v"], ["y"]), validation=None, seed=0)
    schema = pq.read_schema(posixpath.join(data.path, data.files["train"][0][0]))
    assert schema.field("v").type.value_type == pa.float32()
    assert schema.field("y").type == pa.int64()
    rows = sorted(read_split(data, "train"), key=lambda r: r["y"])
    assert rows == [{"v": [0.0, 5.0], "y": 1}, {"v": [1.0, 2.0], "y": 3}]
    assert data.rows("train") == 2 and data.rows("validation") == 0
    assert store.read_json(DatasetFolder(data.path).meta)["rows"]["train"] == 2


def test_fraction_split_is_seeded_complete_and_disjoint(regression_df, store, tmp_path):
    cols = specs(regression_df, ["x"], ["y"])
    data = materialize(regression_df, store, *cols, validation=0.25, seed=3)
    train_y = [r["y"] for r in read_split(data, "train")]
    val_y = [r["y"] for r in read_split(data, "validation")]
    assert len(train_y) + len(val_y) == 200 and 25 <= len(val_y) <= 75
    assert not set(train_y) & set(val_y)
    from spark_estimator import Store

    other = materialize(
        regression_df, Store.create(str(tmp_path / "other")), *cols, validation=0.25, seed=3
    )
    assert sorted(r["y"] for r in read_split(other, "validation")) == sorted(val_y)
    reseeded = materialize(regression_df, store, *cols, validation=0.25, seed=4)
    assert sorted(r["y"] for r in read_split(reseeded, "validation")) != sorted(val_y)


def test_boolean_column_marks_validation_rows(regression_df, store):
    df = regression_df.withColumn("is_val", F.col("id") % 4 == 0)
    data = materialize(df, store, *specs(df, ["x"], ["y"]), validation="is_val", seed=0)
    assert data.rows("validation") == 50 and data.rows("train") == 150
    assert "is_val" not in read_split(data, "train")[0]


def test_same_plan_and_columns_reuse_the_parquet(spark, store, tmp_path):
    path = str(tmp_path / "input")
    spark.range(100).selectExpr("cast(id as double) as x", "id % 2 as y").write.parquet(path)
    first_df = spark.read.parquet(path)
    cols = specs(first_df, ["x"], ["y"])
    first = materialize(first_df, store, *cols, validation=None, seed=0)
    assert not first.reused
    again = materialize(spark.read.parquet(path), store, *cols, validation=None, seed=0)
    assert again.reused and again.path == first.path and again.files == first.files
    assert dataset_folders(store) == [first.path]


def dataset_folders(store):
    """The datasets' folders under ``datasets/`` (not its index)."""
    return sorted(p for p in store.fs.ls(store.datasets, detail=False) if not p.endswith("_index"))


def content(rows, spark, store, partitions=2, validation=None, schema="x array<double>, y long"):
    df = spark.createDataFrame(rows, schema).repartition(partitions)
    data = materialize(df, store, *specs(df, ["x"], ["y"]), validation, 0)
    return data.source["content"]


def test_the_content_digest_ignores_order_and_partitioning_and_changes_with_any_value(spark, store):
    rows = [([float(i), -float(i)], i % 3) for i in range(40)]
    base = content(rows, spark, store)
    assert base["rows"] == 40 and len(base["digest"]) == 16
    assert content(list(reversed(rows)), spark, store, partitions=5) == base
    assert content(rows[20:] + rows[:20], spark, store, partitions=1) == base
    for i, changed in [(7, ([7.0, -7.5], 1)), (7, ([-7.0, 7.0], 1)), (39, ([39.0, -39.0], 1))]:
        other = rows.copy()
        other[i] = changed  # one element, the elements' order, the label
        assert content(other, spark, store)["digest"] != base["digest"], changed
    assert content(rows + rows[:1], spark, store)["rows"] == 41  # a row twice is two rows


def test_the_content_digest_holds_the_rows_of_a_validation_column(spark, store):
    rows = [([float(i)], i % 2, i % 4 == 0) for i in range(40)]
    schema = "x array<double>, y long, v boolean"
    base = content(rows, spark, store, validation="v", schema=schema)
    assert content(rows[::-1], spark, store, 3, validation="v", schema=schema) == base
    moved = [(x, y, not v) if i == 5 else (x, y, v) for i, (x, y, v) in enumerate(rows)]
    assert content(moved, spark, store, validation="v", schema=schema) != base


def new_application(spark):
    """A new Spark application in this process, as a new driver has: another application
    id, so the keys of rows with no identity of their own differ."""
    before = spark.sparkContext.applicationId
    stop_session(LOCAL)
    spark = spark_session(LOCAL)
    assert spark.sparkContext.applicationId != before
    return spark


def test_equal_rows_of_a_new_application_reuse_the_first_copy_and_its_split(spark, store, spy):
    rows = [([float(i), i / 7], i % 3) for i in range(80)]
    schema = "x array<double>, y long"
    df = spark.createDataFrame(rows, schema)  # from a list: keyed with the application's id
    first = materialize(df, store, *specs(df, ["x"], ["y"]), 0.25, 0)
    assert not first.reused
    spark = new_application(spark)
    # the same rows in another order and partitioning, whose own draws would split otherwise
    again_df = spark.createDataFrame(rows[::-1], schema).repartition(3)
    assert key(again_df, ["x"], ["y"], 0.25) != first.source["key"]
    again = materialize(again_df, store, *specs(again_df, ["x"], ["y"]), 0.25, 0)
    assert again.reused and again.path == first.path and again.files == first.files
    assert again.source["key"] == first.source["key"]
    for split in ("train", "validation"):
        assert read_split(again, split) == read_split(first, split)
    assert dataset_folders(store) == [first.path]  # the second copy was dropped
    # the next fit of the new key finds the first copy without a write
    writes = spy(materialize_module, "ParquetTarget")
    third = materialize(again_df, store, *specs(again_df, ["x"], ["y"]), 0.25, 0)
    assert writes == [] and third.reused and third.path == first.path
    # other rows, other write options or another split: a dataset of their own
    changed = spark.createDataFrame([([0.5, 0.0], 0)] + rows[1:], schema)
    for other, split, options in [
        (changed, 0.25, OPTIONS),
        (again_df, 0.25, replace(OPTIONS, num_files=3)),
        (again_df, 0.25, OPTIONS),
    ]:
        cols = specs(other, ["x"], ["y"])
        seed = 1 if other is again_df and options == OPTIONS else 0
        data = materialize(other, store, *cols, split, seed, options)
        assert not data.reused and data.path != first.path


def test_changed_plan_columns_split_or_options_do_not_reuse(spark):
    df = spark.range(100).selectExpr("cast(id as double) as x", "id % 2 as y", "id as z")
    base = key(df, ["x"], ["y"])
    assert key(df, ["x"], ["y"]) == base
    assert key(df.where("x > 3"), ["x"], ["y"]) != base
    assert key(df, ["z"], ["y"]) != base
    assert key(df, ["x"], ["y"], 0.2) != base
    assert key(df, ["x"], ["y"], 0.2, seed=0) != key(df, ["x"], ["y"], 0.2, seed=1)
    cols = sum(specs(df, ["x"], ["y"], "float64"), [])
    assert cache_key(source_fingerprint(df), cols, None, 0, asdict(OPTIONS)) != base
    for change in (dict(num_files=3), dict(row_group_bytes=1024), dict(compression="zstd")):
        assert key(df, ["x"], ["y"], options=replace(OPTIONS, **change)) != base


def test_rewritten_source_files_do_not_reuse(spark, tmp_path):
    path = str(tmp_path / "input")
    spark.range(10).selectExpr("cast(id as double) as x", "id as y").write.parquet(path)
    before = key(spark.read.parquet(path), ["x"], ["y"])
    spark.range(10).selectExpr("cast(id + 1 as double) as x", "id as y").write.mode(
        "append"
    ).parquet(path)
    assert key(spark.read.parquet(path), ["x"], ["y"]) != before


def test_local_rows_are_keyed_by_content_and_rdds_by_identity(spark):
    frame = pd.DataFrame({"x": [1.0, 2.0], "y": [0, 1]})
    local = spark.createDataFrame(frame)
    changed = spark.createDataFrame(frame.assign(x=[1.0, 3.0]))
    assert key(changed, ["x"], ["y"]) != key(local, ["x"], ["y"])
    if source_fingerprint(local)["leaves"][0][0] == "LocalRelation":  # pyspark 4: rows in the plan
        assert key(local, ["x"], ["y"]) == key(spark.createDataFrame(frame.copy()), ["x"], ["y"])
    rows = [(1.0, 0), (2.0, 1)]  # an RDD: the same DataFrame reuses, an equal one may not
    from_rdd = spark.createDataFrame(rows, "x double, y long")
    assert key(from_rdd, ["x"], ["y"]) == key(from_rdd, ["x"], ["y"])
    assert spark.sparkContext.applicationId in json.dumps(source_fingerprint(from_rdd))
    ranged = spark.range(5).selectExpr("cast(id as double) as x", "id as y")
    assert source_fingerprint(ranged)["leaves"][0][0] == "Range"
    assert key(ranged, ["x"], ["y"]) == key(
        spark.range(5).selectExpr("cast(id as double) as x", "id as y"), ["x"], ["y"]
    )


REFIT_SCRIPT = """
    import json, sys
    from pyspark.sql import SparkSession
    from spark_estimator import Store
    from spark_estimator.driver.materialize import WriteOptions, materialize
    from spark_estimator.driver.validate import check_columns, check_sample_weight_col
    spark = SparkSession.builder.master("local[1]").getOrCreate()
    df = spark.read.parquet(sys.argv[1]).where("x > 2")
    features, labels = check_columns(df.schema, ["x"], ["y"])
    options = WriteOptions(num_files=2, row_group_bytes=32 * 2**20, compression="snappy")
    data = materialize(df, Store(sys.argv[2]), features, labels, 0.25, 0, options)
    print(json.dumps({"reused": data.reused, "path": data.path}))
"""


def test_a_new_spark_session_reuses_the_parquet_of_the_same_source(spark, store, tmp_path):
    path = str(tmp_path / "input")
    spark.range(40).selectExpr("cast(id as double) as x", "id % 2 as y").write.parquet(path)
    df = spark.read.parquet(path).where("x > 2")
    first = materialize(df, store, *specs(df, ["x"], ["y"]), 0.25, 0)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(REFIT_SCRIPT), path, store.url],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    other_session = json.loads(result.stdout.strip().splitlines()[-1])
    assert other_session == {"reused": True, "path": first.path}
    meta = store.read_json(DatasetFolder(first.path).meta)
    assert meta["source"]["key"] == posixpath.basename(first.path)
    assert "Filter" in meta["source"]["plan"]
    assert meta["source"]["files"] == len(df.inputFiles())


def test_write_options_shape_the_parquet(spark, store):
    df = spark.range(4000).selectExpr(
        "cast(id as double) as x", "id as y", "cast(id % 4 = 0 as int) as v"
    )
    options = WriteOptions(num_files=3, row_group_bytes=4096, compression="zstd")
    data = materialize(df, store, *specs(df, ["x"], ["y"], "float64"), "v", 0, options)
    assert len(data.files["train"]) == 3 and len(data.files["validation"]) == 3
    assert data.rows("validation") == 1000 and data.rows("train") == 3000  # 0/1 column
    first = pq.ParquetFile(posixpath.join(data.path, data.files["train"][0][0]))
    assert first.metadata.num_row_groups > 1
    assert first.metadata.row_group(0).column(0).compression == "ZSTD"
    assert first.schema_arrow.field("x").type == pa.float64()
    assert first.schema_arrow.field("y").type == pa.int64()


def test_empty_inputs_raise_and_leave_the_store_as_it_was(spark, store, regression_df):
    empty = regression_df.where("id < 0")
    with pytest.raises(ValueError, match="DataFrame: no training rows"):
        materialize(empty, store, *specs(empty, ["x"], ["y"]), validation=None, seed=0)
    df = regression_df.withColumn("is_val", F.lit(False))
    with pytest.raises(ValueError, match="validation: the split 'is_val' selected no"):
        materialize(df, store, *specs(df, ["x"], ["y"]), validation="is_val", seed=0)
    assert store.fs.ls(store.datasets) == []


def test_each_write_has_its_own_folder_named_by_meta(regression_df, store):
    data = materialize(regression_df, store, *specs(regression_df, ["x"], ["y"]), 0.25, 0)
    meta = store.read_json(DatasetFolder(data.path).meta)
    assert data.write_id and meta["write_id"] == data.write_id
    assert data.path == store.dataset(meta["source"]["key"]).path
    for split in ("train", "validation"):
        assert all(f.startswith(f"{data.write_id}/{split}/") for f, _ in data.files[split])
    assert meta["row_lengths"] == {"x": 3}
    assert sorted(store.fs.ls(data.path, detail=False)) == [
        DatasetFolder(data.path).meta,
        DatasetFolder(data.path).write(data.write_id),
    ]


def test_vectors_and_labels_are_checked_by_the_write_and_failures_leave_no_trace(spark, store):
    earlier = store.dataset("earlier").meta
    store.write_bytes(earlier, b"{}")
    cases = [
        ([(Vectors.dense([1.0, 2.0]), 1), (None, 0)], "feature_cols: column 'v' has 1 null"),
        (
            [(Vectors.dense([1.0, 2.0]), 1), (Vectors.sparse(2, [1], [float("nan")]), 0)],
            "feature_cols: column 'v' has 1 NaN or infinite values",
        ),
        (
            [(Vectors.dense([1.0, 2.0]), 1), (Vectors.dense([3.0, 4.0]), None)],
            "label_cols: column 'y' has 1 null values",
        ),
        (
            [(Vectors.dense([1.0, 2.0]), 1), (Vectors.sparse(3, [0], [1.0]), 0)],
            r"feature_cols: column 'v' has vectors of varying size \(2 to 3\)",
        ),
    ]
    for rows, message in cases:
        df = spark.createDataFrame(rows, ["v", "y"])
        with pytest.raises(ValueError, match=message):
            materialize(df, store, *specs(df, ["v"], ["y"]), None, 0)
    weighted = spark.createDataFrame(
        [([1.0], 1, 2.0), ([2.0], 0, None)], "x array<double>, y long, w double"
    )
    weight = check_sample_weight_col(weighted.schema, "w", ["x", "y"], "float32")
    with pytest.raises(ValueError, match="sample_weight_col: column 'w' has 1 null values"):
        _materialize(weighted, store, *specs(weighted, ["x"], ["y"]), None, 0, OPTIONS, weight)
    assert store.fs.find(store.datasets) == [earlier]
    assert store.read_bytes(earlier) == b"{}"


def test_a_reused_dataset_is_checked_against_input_shapes_without_a_job(spark, store):
    df = spark.createDataFrame([(Vectors.dense([1.0, 2.0, 3.0]), 1.0)] * 4, ["v", "y"])
    cols = specs(df, ["v"], ["y"])
    first = _materialize(df, store, *cols, None, 0, OPTIONS, input_shapes=[[-1, 1, 3]])
    assert first.row_lengths == {"v": 3} and not first.reused
    group = f"reuse-{uuid.uuid4().hex}"
    spark.sparkContext.setJobGroup(group, "reuse")
    try:
        with pytest.raises(ValueError, match=r"input_shapes: shape \[-1, 2, 2\] has 4 elements"):
            _materialize(df, store, *cols, None, 0, OPTIONS, input_shapes=[[-1, 2, 2]])
        again = _materialize(df, store, *cols, None, 0, OPTIONS, input_shapes=[[-1, 3]])
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
    assert again.reused and again.row_lengths == {"v": 3}
    assert list(spark.sparkContext.statusTracker().getJobIdsForGroup(group)) == []


def test_concurrent_writes_of_one_key_both_end_complete_and_a_third_call_reuses(
    regression_df, store
):
    cols = specs(regression_df, ["x"], ["y"])
    start = threading.Barrier(2)
    results, errors = [None, None], []

    def write(i):
        try:
            start.wait(timeout=60)
            results[i] = materialize(regression_df, store, *cols, 0.25, 0)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert not all(r.reused for r in results)  # at least one of them wrote
    for data in results:  # each is complete and readable, whoever won
        assert data.rows("train") + data.rows("validation") == 200
        for split in ("train", "validation"):
            assert len(read_split(data, split)) == data.rows(split)
    assert results[0].files.keys() == results[1].files.keys()
    assert [r.rows("validation") for r in results] == [results[0].rows("validation")] * 2
    third = materialize(regression_df, store, *cols, 0.25, 0)
    assert third.reused and third.write_id in {r.write_id for r in results}
    assert third.path == results[0].path == results[1].path
    assert len(read_split(third, "train")) == third.rows("train")


def test_the_executors_write_exactly_the_listed_files_in_a_deterministic_order(
    regression_df, store, tmp_path
):
    from spark_estimator import Store

    cols = specs(regression_df, ["x"], ["y"])
    options = WriteOptions(num_files=3, row_group_bytes=256, compression="gzip")
    data = materialize(regression_df, store, *cols, 0.25, 0, options)
    listed = [f for split in data.files.values() for f, _ in split]
    written = [posixpath.relpath(p, data.path) for p in store.fs.find(data.path)]
    meta_name = posixpath.relpath(DatasetFolder(data.path).meta, data.path)
    assert sorted(written) == sorted([meta_name, *listed])  # no temporary or marker files
    for split in ("train", "validation"):
        names = [posixpath.basename(f) for f, _ in data.files[split]]
        assert names == sorted(names) and len(names) <= 3
        assert set(names) <= {f"part-{p:05d}.parquet" for p in range(3)}
    for rel, groups in data.files["train"]:  # the executors' sizes are the footers'
        meta = pq.ParquetFile(posixpath.join(data.path, rel)).metadata
        assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == groups
        assert meta.row_group(0).column(0).compression == "GZIP"
    again = materialize(
        regression_df, Store.create(str(tmp_path / "again")), *cols, 0.25, 0, options
    )
    for split in ("train", "validation"):  # same rows, same files, same order
        assert [(posixpath.basename(f), g) for f, g in again.files[split]] == [
            (posixpath.basename(f), g) for f, g in data.files[split]
        ]
        assert read_split(again, split) == read_split(data, split)


def test_row_groups_hold_about_row_group_bytes_of_data(spark, store):
    df = spark.range(6000).selectExpr("cast(id as double) as x", "id as y")  # 16 bytes a row
    options = WriteOptions(num_files=2, row_group_bytes=16 * 500, compression="snappy")
    data = materialize(df, store, *specs(df, ["x"], ["y"], "float64"), None, 0, options)
    assert len(data.files["train"]) == 2 and data.rows("train") == 6000
    for _, groups in data.files["train"]:
        assert all(450 <= rows <= 500 for rows in groups[:-1]) and groups[-1] <= 500
