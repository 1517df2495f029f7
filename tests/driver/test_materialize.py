import posixpath

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.ml.linalg import Vectors
from pyspark.sql import functions as F

from spark_estimator.driver.materialize import cache_key, materialize
from spark_estimator.driver.validate import check_columns


def specs(df, features, labels):
    return check_columns(df.schema, features, labels)


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
    assert store.read_json(posixpath.join(data.path, "_meta.json"))["rows"]["train"] == 2


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
    assert len(store.fs.ls(store.join("datasets"))) == 1


def test_changed_plan_or_columns_do_not_reuse(spark, store):
    df = spark.range(100).selectExpr("cast(id as double) as x", "id % 2 as y", "id as z")
    base = cache_key(df, *specs(df, ["x"], ["y"]), None, 0)
    assert cache_key(df, *specs(df, ["x"], ["y"]), None, 0) == base
    assert cache_key(df.where("x > 3"), *specs(df, ["x"], ["y"]), None, 0) != base
    assert cache_key(df, *specs(df, ["z"], ["y"]), None, 0) != base
    assert cache_key(df, *specs(df, ["x"], ["y"]), 0.2, 0) != base
    assert cache_key(df, *specs(df, ["x"], ["y"]), 0.2, 0) != cache_key(
        df, *specs(df, ["x"], ["y"]), 0.2, 1
    )


def test_empty_inputs_raise_and_leave_the_store_as_it_was(spark, store, regression_df):
    empty = regression_df.where("id < 0")
    with pytest.raises(ValueError, match="DataFrame: no training rows"):
        materialize(empty, store, *specs(empty, ["x"], ["y"]), validation=None, seed=0)
    df = regression_df.withColumn("is_val", F.lit(False))
    with pytest.raises(ValueError, match="validation: the split 'is_val' selected no"):
        materialize(df, store, *specs(df, ["x"], ["y"]), validation="is_val", seed=0)
    assert store.fs.ls(store.join("datasets")) == []
