import itertools
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_estimator import Store
from spark_estimator.worker.data.arrow_reader import ArrowReader
from spark_estimator.worker.data.shards import Piece, shard_pieces
from tests.conftest import write_id_dataset


def test_chunks_follow_the_piece_order_with_slices(tmp_path, store):
    data = write_id_dataset(tmp_path, [10, 1, 12], row_group_size=4)
    reader = ArrowReader(store, data.path, data.columns, num_workers=3)
    pieces = shard_pieces(data.files["train"], 3, 1)  # rows 8..15: cuts two row groups
    chunks = list(reader.chunks(reversed(pieces)))
    expected = [list(range(8, 10)), [10], list(range(11, 15)), [15]][::-1]
    assert [c["y"].tolist() for c in chunks] == expected
    first = chunks[-1]
    assert first["x"].dtype == np.float32 and first["x"].shape == (2, 2)
    assert (first["x"][:, 1] == -first["y"]).all()


def test_vector_columns_are_read_in_the_dtype_their_column_asks_for(tmp_path, store):
    # fit_on_parquet on Parquet with ML vector structs (pyspark.ml's encoding)
    from spark_estimator.shared.spec import ColumnSpec
    from tests.worker.data.test_convert import VECTOR

    big = 2.0**24 + 1
    rows = [
        {"type": 1, "size": None, "indices": None, "values": [big, 1.0]},
        {"type": 0, "size": 2, "indices": [0], "values": [big + 2]},
    ]
    (tmp_path / "train").mkdir()
    pq.write_table(pa.table({"v": pa.array(rows, type=VECTOR)}), tmp_path / "train" / "p.parquet")
    for dtype, np_dtype in (("float64", np.float64), ("float32", np.float32)):
        reader = ArrowReader(store, str(tmp_path), [ColumnSpec("v", "vector", dtype)], 1)
        (chunk,) = reader.chunks([Piece("train/p.parquet", 0, 0, 2, 2)])
        expected = np.array([[big, 1.0], [big + 2, 0.0]]).astype(np_dtype)
        assert chunk["v"].dtype == np_dtype and (chunk["v"] == expected).all()


def test_a_failed_read_surfaces_in_the_consumer(tmp_path, store):
    data = write_id_dataset(tmp_path, [8], row_group_size=4)
    reader = ArrowReader(store, data.path, data.columns, num_workers=2)
    bad = Piece("train/missing.parquet", 0, 0, 4, 4)
    stream = reader.chunks([Piece("train/part-00000.parquet", 0, 0, 4, 4), bad])
    assert next(stream)["y"].tolist() == [0, 1, 2, 3]
    with pytest.raises(FileNotFoundError):
        next(stream)


def test_an_abandoned_stream_stops_reading(tmp_path, store):
    data = write_id_dataset(tmp_path, [40], row_group_size=1)
    reader = ArrowReader(store, data.path, data.columns, num_workers=2)
    stream = reader.chunks(shard_pieces(data.files["train"], 1, 0))
    next(stream)
    stream.close()  # cancels queued reads and joins the pool without reading 40 groups
    assert len(reader._footers) == 1


def test_reads_through_fsspec_for_non_local_stores():
    store = Store.create("memory://arrow-reader-test")
    table = pa.table({"x": pa.array([1.5, 2.5, 3.5], pa.float64()), "y": [0, 1, 0]})
    with store.fs.open(store.join("train", "f.parquet"), "wb") as f:
        pq.write_table(table, f, row_group_size=2)
    from spark_estimator.shared.spec import ColumnSpec

    columns = [ColumnSpec("x", "scalar", "float64"), ColumnSpec("y", "scalar", "int64")]
    reader = ArrowReader(store, store.root, columns, num_workers=1)
    chunk = reader.read(Piece("train/f.parquet", 1, 0, 1, 1))
    assert chunk["x"].dtype == np.float64 and chunk["x"].tolist() == [3.5]


def test_reads_ahead_in_num_workers_threads(tmp_path, store):
    data = write_id_dataset(tmp_path, [64], row_group_size=2)
    reader = ArrowReader(store, data.path, data.columns, num_workers=3)
    together = threading.Barrier(3, timeout=30)
    started, threads, read = itertools.count(), set(), reader.read

    def read_in_step(piece):
        threads.add(threading.current_thread().name)
        if next(started) < 3:  # the first three reads end only once all three have begun
            together.wait()
        return read(piece)

    reader.read = read_in_step
    stream = reader.chunks(shard_pieces(data.files["train"], 1, 0))
    assert sum(len(c["y"]) for c in stream) == 64
    assert len(threads) == 3 and all(t.startswith("spark-estimator-read") for t in threads)
