"""The executor-side Parquet writer of materialize, without Spark: row groups by size, one
file per split and partition, atomic files (a failed attempt leaves nothing, a retry
replaces), any fsspec store."""

import posixpath
import uuid
from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_estimator import Store
from spark_estimator.driver.parquet_dataset import list_row_groups
from spark_estimator.shared.column_stats import CheckedColumn
from spark_estimator.worker.data.parquet_writer import (
    ParquetTarget,
    PartitionWriter,
    RowGroupBuffer,
)

SPLIT = "__split"


def ids(start: int, rows: int) -> pa.Table:
    return pa.table({"i": pa.array(range(start, start + rows), pa.int64())})  # 8 bytes a row


def batches(splits: list[str], width: int = 2) -> list[pa.RecordBatch]:
    """Row n has id n, x = [n, -n] (float32) and split ``splits[n]``, in batches of 4."""
    n = len(splits)
    table = pa.table(
        {
            "i": pa.array(range(n), pa.int64()),
            "x": pa.array(
                [[float(v), -float(v)][:width] for v in range(n)], pa.list_(pa.float32())
            ),
            SPLIT: pa.array(splits, pa.string()),
        }
    )
    return table.to_batches(max_chunksize=4)


def target(store: Store, row_group_bytes: int = 2**20, compression: str = "snappy"):
    dataset = store.dataset("key")
    return ParquetTarget(store, dataset, "write-1", SPLIT, row_group_bytes, compression)


def write_folder(t: ParquetTarget) -> str:
    return t.dataset.write(t.write_id)


def test_row_groups_hold_about_the_target_bytes_in_input_order():
    buffer = RowGroupBuffer(row_group_bytes=800)  # 100 rows of int64
    groups, start = [], 0
    for _ in range(50):  # 350 rows in tables of 7: groups cut across tables
        groups += buffer.add(ids(start, 7))
        start += 7
    rest = buffer.rest()
    assert [g.num_rows for g in groups] == [100, 100, 100] and rest.num_rows == 50
    values = [v for t in [*groups, rest] for v in t.column("i").to_pylist()]
    assert values == list(range(350))


def test_a_table_larger_than_several_groups_is_cut_and_nothing_is_left():
    buffer = RowGroupBuffer(row_group_bytes=800)
    groups = buffer.add(ids(0, 1000))
    assert [g.num_rows for g in groups] == [100] * 10 and buffer.rest() is None


def test_rows_wider_than_the_target_make_one_row_groups():
    buffer = RowGroupBuffer(row_group_bytes=4)
    assert [g.num_rows for g in buffer.add(ids(0, 3))] == [1, 1, 1]


def test_each_split_goes_to_its_own_file_in_order_without_the_split_column(store):
    splits = ["train", "validation", "train", "train", "validation"] * 6  # 30 rows
    t = target(store, row_group_bytes=64, compression="zstd")
    written = PartitionWriter(t, partition=3).write(iter(batches(splits)))
    assert [(s, p) for s, p, *_ in written] == [
        ("train", "write-1/train/part-00003.parquet"),
        ("validation", "write-1/validation/part-00003.parquet"),
    ]
    for split, path, groups, _ in written:
        parquet = pq.ParquetFile(posixpath.join(t.dataset.path, path))
        rows = parquet.read().to_pylist()
        assert [r["i"] for r in rows] == [i for i, s in enumerate(splits) if s == split]
        assert rows[1]["x"] == [float(rows[1]["i"]), -float(rows[1]["i"])]
        assert parquet.schema_arrow.names == ["i", "x"]
        meta = parquet.metadata
        assert groups == [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        assert len(groups) > 1 and meta.row_group(0).column(0).compression == "ZSTD"
        # the int ids are dictionary encoded, the floats are not
        encodings = [meta.row_group(0).column(c).encodings for c in range(2)]
        assert "RLE_DICTIONARY" in encodings[0] and "RLE_DICTIONARY" not in encodings[1]
    assert list_row_groups(store, write_folder(t), t.dataset.path) == sorted(
        (p, g) for _, p, g, _ in written
    )


def test_uncompressed_and_a_split_without_rows_get_no_codec_and_no_file(store):
    t = target(store, compression="uncompressed")
    written = PartitionWriter(t, partition=0).write(iter(batches(["train"] * 9)))
    assert [(s, p, g) for s, p, g, _ in written] == [
        ("train", "write-1/train/part-00000.parquet", [9])
    ]
    meta = pq.ParquetFile(posixpath.join(t.dataset.path, written[0][1])).metadata
    assert meta.row_group(0).column(0).compression == "UNCOMPRESSED"
    assert not store.exists(posixpath.dirname(t.path("validation", 0)))
    assert PartitionWriter(t, partition=1).write(iter([])) == []
    assert store.fs.find(write_folder(t)) == [posixpath.join(t.dataset.path, written[0][1])]


def test_each_file_reports_the_value_counts_of_its_own_rows(store):
    splits = ["train"] * 7 + ["validation"] * 3
    checked = (CheckedColumn("x", array=True, finite=True),)
    t = replace(target(store), checked=checked)
    written = PartitionWriter(t, partition=0).write(iter(batches(splits)))
    lengths = {"c0_min_length": 2, "c0_max_length": 2}
    clean = {"c0_null_rows": 0, "c0_null_elements": 0, "c0_non_finite": 0, **lengths}
    assert {split: stats for split, _, _, stats in written} == {
        "train": clean,
        "validation": clean,
    }


def failing_after(items: list, count: int):
    yield from items[:count]
    raise OSError("executor lost its disk")


def test_a_failed_attempt_leaves_no_file_and_a_retry_replaces_the_old_one(store):
    t = target(store, row_group_bytes=32)  # row groups are written before the failure
    rows = batches(["train", "validation"] * 8)
    first = PartitionWriter(t, 0).write(iter(rows[:1]))
    paths = [posixpath.join(t.dataset.path, p) for _, p, *_ in first]
    before = {p: store.read_bytes(p) for p in paths}
    with pytest.raises(OSError, match="lost its disk"):
        PartitionWriter(t, 0).write(failing_after(rows, 3))
    assert {p: store.read_bytes(p) for p in paths} == before  # the earlier complete files
    assert sorted(store.fs.find(write_folder(t))) == sorted(paths)  # no temporary file left
    retry = PartitionWriter(t, 0).write(iter(rows))
    assert [posixpath.join(t.dataset.path, p) for _, p, *_ in retry] == paths
    assert pq.read_table(paths[0]).column("i").to_pylist() == list(range(0, 16, 2))
    assert pq.read_table(paths[1]).column("i").to_pylist() == list(range(1, 16, 2))


def test_a_temporary_file_left_by_a_killed_attempt_is_never_listed(store):
    t = target(store)
    written = PartitionWriter(t, 0).write(iter(batches(["train"] * 5)))
    path = posixpath.join(t.dataset.path, written[0][1])
    leftover = posixpath.join(
        posixpath.dirname(path), f".tmp-{uuid.uuid4().hex}-part-00001.parquet"
    )
    store.fs.pipe_file(leftover, b"PAR1 half a file")
    assert list_row_groups(store, write_folder(t), t.dataset.path) == [(written[0][1], [5])]


def test_writes_through_any_fsspec_filesystem():
    store = Store.create(f"memory://writer-{uuid.uuid4().hex}")
    try:
        t = target(store, row_group_bytes=16)
        written = PartitionWriter(t, 7).write(iter(batches(["validation"] * 6)))
        assert [(s, p) for s, p, *_ in written] == [
            ("validation", "write-1/validation/part-00007.parquet")
        ]
        with store.fs.open(posixpath.join(t.dataset.path, written[0][1]), "rb") as f:
            assert pq.read_table(f).column("i").to_pylist() == list(range(6))
        assert len(written[0][2]) > 1
    finally:
        store.remove(store.root)
