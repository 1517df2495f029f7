"""A lake table's folder read as plain Parquet is refused before any Spark job
(``table_folders.check_not_table_folder``): the folder also holds the files of removed rows
and older versions, so Spark's rows are already wrong, in place or copied."""

from __future__ import annotations

import json
import sys
import uuid

import numpy as np
import pyarrow as pa
import pytest

from spark_estimator.driver import table_folders, training_job
from tests.conftest import make_estimator

deltalake = pytest.importorskip("deltalake")


def _rows(ids) -> pa.Table:
    ids = np.asarray(list(ids), dtype=np.int64)
    return pa.table(
        {
            "id": ids,
            "part": pa.array([int(i % 2) for i in ids], pa.int64()),
            "x": pa.array([[float(i), 1.0, -1.0] for i in ids], pa.list_(pa.float64())),
            "y": pa.array(ids.astype(np.float64)),
        }
    )


def _delta_table(path, partitioned: bool = False) -> int:
    """A Delta table of 3 versions (write, append, delete): 40 rows written, 30 live; the
    version it ends at."""
    kwargs = {"partition_by": ["part"]} if partitioned else {}
    deltalake.write_deltalake(str(path), _rows(range(20)), **kwargs)
    deltalake.write_deltalake(str(path), _rows(range(20, 40)), mode="append", **kwargs)
    table = deltalake.DeltaTable(str(path))
    table.delete("id < 10")
    return table.version()


def _iceberg_table(tmp_path):
    """An Iceberg table (sqlite catalog) of 2 snapshots, 40 rows; its location."""
    from pyiceberg.catalog.sql import SqlCatalog

    warehouse = tmp_path / "warehouse"
    warehouse.mkdir()
    catalog = SqlCatalog(
        "local", uri=f"sqlite:///{tmp_path / 'catalog.db'}", warehouse=f"file://{warehouse}"
    )
    catalog.create_namespace("db")
    rows = _rows(range(20))
    table = catalog.create_table("db.points", schema=rows.schema)
    table.append(rows)
    table.append(_rows(range(20, 40)))
    return table.location().removeprefix("file://"), table.current_snapshot().snapshot_id


def _refused(spark, store, df, monkeypatch, **params):
    launched = []
    monkeypatch.setattr(training_job, "run_barrier_job", lambda *a, **k: launched.append(a))
    group = f"table-folder-{uuid.uuid4().hex}"
    spark.sparkContext.setJobGroup(group, "a table's folder")
    try:
        with pytest.raises(ValueError) as raised:
            make_estimator(store=store, num_proc=1, epochs=1, **params).fit(df)
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
    assert list(spark.sparkContext.statusTracker().getJobIdsForGroup(group)) == []
    assert launched == []
    # nothing written, in place or copied
    assert not store.fs.exists(store.datasets) and not store.fs.exists(store.join("tables"))
    return str(raised.value)


@pytest.mark.parametrize("data_copy", ["auto", "always"])
def test_a_delta_tables_folder_read_as_parquet_is_refused(
    data_copy, spark, store, tmp_path, monkeypatch
):
    root = tmp_path / "events"
    version = _delta_table(root)
    df = spark.read.parquet(str(root))
    assert df.count() == 50  # removed rows too: the rewritten file and the old one (30 live)
    message = _refused(spark, store, df, monkeypatch, data_copy=data_copy)
    assert "Delta table" in message and str(root) in message
    assert 'spark.read.format("delta")' in message  # how to read it instead
    assert f"version {version}" in message and "30 live rows" in message


def test_a_partition_folder_of_a_delta_table_is_refused(spark, store, tmp_path, monkeypatch):
    root = tmp_path / "events"
    _delta_table(root, partitioned=True)
    df = spark.read.parquet(str(root / "part=1"))
    message = _refused(spark, store, df, monkeypatch)
    assert "Delta table" in message and str(root) in message


def test_an_iceberg_tables_data_folder_is_refused(spark, store, tmp_path, monkeypatch):
    pytest.importorskip("pyiceberg")
    location, snapshot = _iceberg_table(tmp_path)
    df = spark.read.parquet(f"{location}/data")
    message = _refused(spark, store, df, monkeypatch)
    assert "Iceberg table" in message and location in message
    assert f"snapshot {snapshot}" in message and "40 rows" in message


def test_the_newest_metadata_file_names_the_iceberg_snapshot(tmp_path):
    """The current snapshot is read from the highest-numbered metadata file, with no reader
    installed: ``00010-...`` after ``00002-...``."""
    metadata = tmp_path / "metadata"
    metadata.mkdir()
    for number, snapshot in ((2, 7), (10, 8)):
        doc = {
            "current-snapshot-id": snapshot,
            "snapshots": [{"snapshot-id": snapshot, "summary": {"total-records": str(snapshot)}}],
        }
        (metadata / f"{number:05d}-{uuid.uuid4()}.metadata.json").write_text(json.dumps(doc))
    assert table_folders.iceberg_state(str(tmp_path)) == "at snapshot 8 (8 rows)"


def test_without_deltalake_the_version_comes_from_the_log(tmp_path, monkeypatch):
    version = _delta_table(tmp_path / "events")
    monkeypatch.setitem(sys.modules, "deltalake", None)  # its import fails
    assert table_folders.delta_state(str(tmp_path / "events")) == f"at version {version}"


def test_plain_parquet_beside_a_table_is_not_refused(spark, store, tmp_path):
    """Only a folder inside a table is refused: a Parquet folder next to one trains."""
    _delta_table(tmp_path / "events")
    plain = tmp_path / "plain"
    spark.createDataFrame(
        [([float(i), 1.0, -1.0], float(i)) for i in range(20)], "x array<double>, y double"
    ).write.parquet(str(plain))
    model = make_estimator(store=store, num_proc=1, epochs=1).fit(spark.read.parquet(str(plain)))
    assert model.getTrainingSummary()["dataset_in_place"]
