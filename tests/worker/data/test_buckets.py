"""Length bucketing: each shuffle window's served rows regrouped by length, every row once
per pass, in one order whatever batch sizes cut the pass (real Parquet where it matters)."""

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from spark_estimator.shared.spec import ColumnSpec, DatasetInfo, DecodeSpec
from spark_estimator.worker.data.buckets import Bucketing, group_order
from spark_estimator.worker.data.columns import Layout
from spark_estimator.worker.data.loader import buffered_batches, open_loader
from spark_estimator.worker.data.remainder import after, own_runs, remainder_batches, reshard
from spark_estimator.worker.data.shards import StepPlan
from spark_estimator.worker.data.shuffle import pass_order, windows
from tests.worker.data.test_loader import train_spec


def lengths_of(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 201, n)


def sequence_layout():
    template = {
        "s": np.empty(0, dtype=object),
        "y": torch.empty(0, dtype=torch.int64),
        "w": torch.empty(0, dtype=torch.float32),
    }
    columns = [
        ColumnSpec("s", "sequence", "int64"),
        ColumnSpec("y", "scalar", "int64"),
        ColumnSpec("w", "scalar", "float32"),
    ]
    return Layout(template, columns)


def ragged_chunks(layout, rows_of_chunks, lengths):
    """Chunks whose row i has id ``y`` = i, a sequence ``s`` of ``lengths[i]`` values (all
    i) and ``w`` = -i: a row's columns must travel together."""
    chunks, at = [], 0
    for n in rows_of_chunks:
        ids = np.arange(at, at + n)
        s = np.empty(n, dtype=object)
        s[:] = [np.full(lengths[i], i) for i in ids]
        chunks.append(layout.assemble({"s": s, "y": ids, "w": -ids.astype(np.float32)}))
        at += n
    return chunks


def bucketed_pass(rows_of_chunks, lengths, sizes, buffer, group=8, seed=3):
    layout = sequence_layout()
    chunks = ragged_chunks(layout, rows_of_chunks, lengths)
    bucket = Bucketing(["s"], group, seed=seed, rank=0)
    return list(
        buffered_batches(
            iter(chunks),
            sizes,
            layout,
            rows_of_chunks,
            buffer_rows=buffer,
            generator=torch.Generator().manual_seed(seed),
            regroup=lambda rows, window: bucket.regroup(rows, 1, window),
        )
    )


def test_group_order_sorts_by_length_in_groups_served_in_a_random_order():
    lengths = np.array([5, 1, 9, 3, 7, 2, 8, 4, 6])
    order = group_order(lengths, 3, np.random.default_rng(0))
    assert sorted(order.tolist()) == list(range(9))
    groups = [lengths[order[i : i + 3]].tolist() for i in range(0, 9, 3)]
    assert sorted(groups) == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    orders = {tuple(group_order(lengths, 3, np.random.default_rng(s))) for s in range(10)}
    assert len(orders) > 1  # the groups' order is drawn
    # ties keep the order they came in (the window's random one)
    assert group_order(np.array([2, 1, 2, 1]), 4, np.random.default_rng(0)).tolist() == [
        1,
        3,
        0,
        2,
    ]


def test_a_rows_length_sums_its_sequences_and_strings():
    template = {"s": np.empty(0, dtype=object), "t": np.empty(0, dtype=object)}
    columns = [ColumnSpec("s", "sequence", "int64"), ColumnSpec("t", "string", "float32")]
    layout = Layout(template, columns)
    s, t = np.empty(3, dtype=object), np.empty(3, dtype=object)
    s[:] = [np.arange(4), np.arange(0), np.arange(2)]
    t[:] = ["abc", "", None]  # a null string: length 0 (decoding names the row)
    rows = layout.assemble({"s": s, "t": t})
    assert Bucketing(["s", "t"], 8, 0, 0).lengths(rows).tolist() == [7, 0, 2]
    assert Bucketing(["s"], 8, 0, 0).lengths(rows).tolist() == [4, 0, 2]


@pytest.mark.parametrize("buffer", [7, 30, 1000])
def test_a_bucketed_pass_is_one_order_whatever_batch_sizes_cut_it(buffer):
    # the rest of a resized epoch reads a pass again in other sizes: same rows, same order
    rows = [13, 4, 20, 9, 16, 11, 7]  # 80
    lengths = lengths_of(80)

    def order(sizes):
        batches = bucketed_pass(rows, lengths, sizes, buffer)
        for b in batches:  # each row's columns stayed together
            assert b["w"].tolist() == [-float(i) for i in b["y"].tolist()]
            assert [int(s[0]) for s in b["s"]] == b["y"].tolist()
        return [i for b in batches for i in b["y"].tolist()]

    expected = order([80])
    assert sorted(expected) == list(range(80))
    for sizes in ([1] * 80, [8] * 10, [3] * 26 + [2], [0, 17, 2, 0, 61], [9, 71], [45]):
        assert order(sizes) == expected[: sum(sizes)]


@pytest.mark.parametrize("buffer", [10, 30])
def test_each_window_serves_the_rows_it_serves_without_bucketing(buffer):
    rows = [8] * 10
    lengths = lengths_of(80, seed=1)
    bucketed = [i for b in bucketed_pass(rows, lengths, [80], buffer) for i in b["y"].tolist()]
    plain = pass_order(rows, buffer, torch.Generator().manual_seed(3)).tolist()
    assert bucketed != plain
    at = 0
    for window in windows(rows, buffer, torch.Generator().manual_seed(3)):
        assert sorted(bucketed[at : at + window.serve]) == sorted(plain[at : at + window.serve])
        at += window.serve
    assert at == 80


def test_batches_hold_rows_of_similar_lengths_and_pad_less():
    rows, size = [50] * 20, 16  # 1000 rows, one window
    lengths = lengths_of(1000, seed=2)
    sizes = [size] * 62 + [8]

    def padded_share(batches):
        real = padded = 0
        for b in batches:
            n = [len(s) for s in b["s"]]
            real, padded = real + sum(n), padded + max(n) * len(n)
        return 1 - real / padded

    bucketed = bucketed_pass(rows, lengths, sizes, buffer=None, group=8 * size)
    plain = list(
        buffered_batches(
            iter(ragged_chunks(sequence_layout(), rows, lengths)),
            sizes,
            sequence_layout(),
            rows,
            buffer_rows=None,
            generator=torch.Generator().manual_seed(3),
        )
    )
    assert padded_share(plain) > 0.4
    assert padded_share(bucketed) < 0.1
    spread = [max(map(len, b["s"])) - min(map(len, b["s"])) for b in bucketed]
    assert np.median(spread) <= 10  # of lengths 1..200
    # the lengths along the pass stay mixed: not one long sort
    firsts = [len(b["s"][0]) for b in bucketed]
    assert firsts != sorted(firsts)


def write_ragged_dataset(root, file_rows: list[int], row_group_size: int) -> DatasetInfo:
    """Parquet under ``root/train``: id ``y`` = row index, ``s`` a list of int64 of a
    random length 1..200 (its values all the id)."""
    folder = root / "train"
    folder.mkdir(parents=True, exist_ok=True)
    lengths = lengths_of(sum(file_rows), seed=4)
    files, start = [], 0
    for i, n in enumerate(file_rows):
        ids = range(start, start + n)
        start += n
        table = pa.table(
            {
                "s": pa.array([[j] * int(lengths[j]) for j in ids], pa.list_(pa.int64())),
                "y": pa.array(list(ids), pa.int64()),
            }
        )
        path = folder / f"part-{i:05d}.parquet"
        pq.write_table(table, path, row_group_size=row_group_size)
        meta = pq.ParquetFile(path).metadata
        groups = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        files.append((f"train/{path.name}", groups))
    return DatasetInfo(
        path=str(root),
        features=[ColumnSpec("s", "sequence", "int64")],
        labels=[ColumnSpec("y", "scalar", "int64")],
        files={"train": files},
    )


def bucket_spec(data, store, bucket=True, buffer=None):
    return train_spec(
        data, store, shuffle_buffer_size=buffer, decode=DecodeSpec(bucket_by_length=bucket)
    )


@pytest.mark.parametrize("buffer", [None, 9])
def test_the_loader_buckets_training_passes_every_row_once_with_equal_steps(
    tmp_path, store, buffer
):
    data = write_ragged_dataset(tmp_path, [40, 23, 37], row_group_size=10)  # 100 rows
    spec, plain = bucket_spec(data, store, buffer=buffer), bucket_spec(data, store, False, buffer)
    world, batch = 3, 4  # train_spec's batch_size: groups of 32 rows
    for pass_index in (1, 2):
        seen, steps = [], set()
        for rank in range(world):
            sizes = StepPlan(100, world, rank, batch).batch_sizes
            loader = open_loader(spec, "train", world, rank, pin=False)
            assert loader.bucket is not None
            got = [b["y"].tolist() for b in loader.batches(sizes, pass_index)]
            steps.add(len(got))
            seen += [i for b in got for i in b]
            unbucketed = open_loader(plain, "train", world, rank, pin=False)
            assert unbucketed.bucket is None
            other = [b["y"].tolist() for b in unbucketed.batches(sizes, pass_index)]
            assert got != other and sorted(sum(got, [])) == sorted(sum(other, []))
        assert len(steps) == 1 and sorted(seen) == list(range(100))
    assert open_loader(spec, "validation", world, 0, pin=False).bucket is None
    unshuffled = train_spec(data, store, shuffle=False, decode=DecodeSpec(bucket_by_length=True))
    assert open_loader(unshuffled, "train", world, 0, pin=False).bucket is None


@pytest.mark.parametrize("buffer", [None, 7])
@pytest.mark.parametrize("old, new, steps_done", [(3, 2, 2), (2, 3, 5)])
def test_the_rest_of_a_resized_bucketed_epoch_is_the_rest_of_its_order(
    tmp_path, store, buffer, old, new, steps_done
):
    data = write_ragged_dataset(tmp_path, [40, 23, 37], row_group_size=10)  # 100 rows
    spec = bucket_spec(data, store, buffer=buffer)
    batch, pass_index = 3, 2
    opened = {}

    def source(world, rank):
        return opened.setdefault((world, rank), open_loader(spec, "train", world, rank, False))

    trained, consumed, rest = [], [], []
    for rank in range(old):
        plan = StepPlan(100, old, rank, batch)
        whole = [b["y"].tolist() for b in source(old, rank).batches(plan.batch_sizes, pass_index)]
        done = plan.batch_sizes[:steps_done]
        trained += [i for b in whole[:steps_done] for i in b]
        rest += [i for b in whole[steps_done:] for i in b]
        consumed.append(sum(done))
    parts = reshard([after(r, n) for r, n in zip(own_runs(100, old), consumed)], new)
    rows = [sum(run.rows for run in p) for p in parts]
    template = {"s": np.empty(0, dtype=object), "y": torch.empty(0, dtype=torch.int64)}
    reread = []
    for rank in range(new):
        plan = StepPlan.over(rows, rank, batch)
        for b in remainder_batches(parts[rank], plan.batch_sizes, pass_index, source, template):
            reread += b["y"].tolist()
    assert reread == rest  # the rows not trained on, in the order they would have come
    counts = Counter(trained + reread)
    assert sorted(counts) == list(range(100)) and set(counts.values()) == {1}
