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


def in_place_table(tmp_path, name: str, row_group_size: int, rows: int = 600, fraction=0.25):
    """One Parquet file of ``rows`` rows (y = id, x = [id, -id]) in row groups of
    ``row_group_size``, described as a table read in place with a ``fraction`` split."""
    from spark_estimator.driver.in_place import table_layout
    from spark_estimator.shared.row_split import RowSplit
    from spark_estimator.shared.spec import ColumnSpec, DatasetInfo, InPlace

    folder = tmp_path / name
    folder.mkdir()
    ids = np.arange(rows)
    x = pa.array([[float(i), -float(i)] for i in ids], pa.list_(pa.float32()))
    pq.write_table(
        pa.table({"x": x, "y": ids}), folder / "t.parquet", row_group_size=row_group_size
    )
    footer = pq.ParquetFile(folder / "t.parquet").metadata
    layout, group_bytes = table_layout(["t.parquet"], [footer], ["x", "y"])
    split = RowSplit(fraction=fraction, seed=1)
    held, first = [], 0
    for n in layout[0][1]:
        held.append(int(split.validation(first, n).sum()))
        first += n
    files = {
        "train": [("t.parquet", [n - h for n, h in zip(layout[0][1], held)])],
        "validation": [("t.parquet", held)],
    }
    size = (folder / "t.parquet").stat().st_size
    in_place = InPlace(
        tuple((p, tuple(g)) for p, g in layout), (("t.parquet", size),), fraction, 1, None,
        group_bytes,
    )  # fmt: skip
    data = DatasetInfo(
        path=str(folder),
        features=[ColumnSpec("x", "array", "float32")],
        labels=[ColumnSpec("y", "scalar", "int64")],
        files=files,
        in_place=in_place,
    )
    expected = {s: sorted(ids[split.rows(s, 0, rows)].tolist()) for s in ("train", "validation")}
    return data, expected


@pytest.mark.parametrize("group_rows", [600, 3], ids=["one huge row group", "200 tiny ones"])
def test_a_table_in_place_is_read_in_even_pieces_every_row_once(
    tmp_path, store, monkeypatch, group_rows
):
    """Lake row groups re-cut (a huge one decoded once per pass, part after part; tiny
    ones joined): shuffled passes on 1-3 ranks still give each row of a split once."""
    from spark_estimator.shared.spec import LoaderSpec, TrainSpec
    from spark_estimator.worker.data import arrow_reader, shards
    from spark_estimator.worker.data.loader import open_loader
    from spark_estimator.worker.data.shards import StepPlan

    monkeypatch.setattr(shards, "PIECE_BYTES", 2000)  # ~100 rows; 9 tiny row groups
    data, expected = in_place_table(tmp_path, "t", group_rows)
    opened = []
    real_open = arrow_reader.ArrowReader._open

    def counting(self, path):
        opened.append(path)
        return real_open(self, path)

    monkeypatch.setattr(arrow_reader.ArrowReader, "_open", counting)
    loader_spec = LoaderSpec(shuffle=True, shuffle_buffer_size=70, num_workers=2)
    spec = TrainSpec(
        bundle=b"", data=data, store=store, run_id="r", batch_size=16, epochs=1, seed=0,
        use_gpu=False, input_shapes=None, loader=loader_spec,
    )  # fmt: skip
    for world in (1, 2, 3):
        for split in ("train", "validation"):
            seen = []
            for rank in range(world):
                loader = open_loader(spec, split, world, rank, pin=False)
                if group_rows == 600 and split == "train":
                    assert len(loader.pieces) >= 2  # the row group's parts
                    opened.clear()
                if group_rows == 3:
                    groups = sum(1 for p in loader.pieces for _ in range(p.groups))
                    assert len(loader.pieces) <= groups / 5  # joined
                sizes = StepPlan(data.rows(split), world, rank, 16).batch_sizes
                for batch in loader.batches(sizes, 2):
                    seen += batch["y"].tolist()
                    assert (batch["x"][:, 0] == batch["y"]).all()
                if group_rows == 600 and split == "train":
                    assert len(opened) == 1  # decoded once in the pass, part after part
            assert sorted(seen) == expected[split]


def test_the_first_rows_of_a_huge_row_group_in_place_are_read_without_the_rest(
    tmp_path, store, monkeypatch
):
    """A probe's or a template's first rows: decoded from the row group's start only, not
    the whole row group."""
    from spark_estimator.worker.data import shards

    monkeypatch.setattr(shards, "PIECE_BYTES", 2000)
    data, expected = in_place_table(tmp_path, "t", 600, rows=6000)
    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", None)  # no whole row group
    reader = ArrowReader(store, data.path, data.columns, 1, None, data.in_place, "train")
    for g, rows in enumerate(data.files["train"][0][1][:3]):
        chunk = reader.read(Piece("t.parquet", g, 0, 3, rows))
        want = [i for i in expected["train"] if 600 * g <= i < 600 * (g + 1)][:3]
        assert chunk["y"].tolist() == want


@pytest.mark.parametrize("where", ["local", "fsspec"])
def test_pieces_are_decoded_into_the_read_pool_not_the_default_one(tmp_path, where):
    # mimalloc (the default pool) gives freed pages back after 10 ms: each piece's buffers
    # were faulted in fresh; jemalloc keeps them for the next piece (see arrow_reader)
    from spark_estimator.shared.spec import ColumnSpec
    from spark_estimator.worker.data.arrow_reader import read_pool

    pool = read_pool()
    if pool is None:
        pytest.skip(f"the default pool is {pa.default_memory_pool().backend_name} already")
    store = Store.create(str(tmp_path) if where == "local" else "memory://read-pool-test")
    blobs = [bytes([i]) * 100_000 for i in range(8)]
    store.fs.makedirs(store.join("train"), exist_ok=True)
    with store.fs.open(store.join("train", "f.parquet"), "wb") as f:
        pq.write_table(pa.table({"b": pa.array(blobs, pa.binary())}), f, row_group_size=4)
    reader = ArrowReader(store, store.root, [ColumnSpec("b", "binary", "float32")], 1)
    before = pool.bytes_allocated()
    chunk = reader.read(Piece("train/f.parquet", 1, 0, 4, 4))
    assert pool.bytes_allocated() - before >= 400_000  # the values, held by the chunk
    assert [bytes(v) for v in np.asarray(chunk["b"])] == blobs[4:]
    del chunk
    assert pool.bytes_allocated() - before < 400_000
