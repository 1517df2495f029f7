import operator

import numpy as np
import pytest
import torch

from spark_estimator.shared.spec import ColumnSpec, LoaderSpec, TrainSpec
from spark_estimator.worker.data.columns import Layout
from spark_estimator.worker.data.loader import buffered_batches, open_loader
from spark_estimator.worker.data.shards import StepPlan
from spark_estimator.worker.data.shuffle import pass_order
from tests.conftest import write_id_dataset


def train_spec(data, store, seed=0, **loader) -> TrainSpec:
    return TrainSpec(
        bundle=b"",
        data=data,
        store=store,
        run_id="r",
        batch_size=4,
        epochs=1,
        seed=seed,
        use_gpu=False,
        input_shapes=None,
        loader=LoaderSpec(**loader),
    )


def epoch_ids(spec, world, batch, pass_index, split="train"):
    """Per rank, the list of batches (as id lists) of one pass."""
    total = spec.data.rows(split)
    out = []
    for rank in range(world):
        loader = open_loader(spec, split, world, rank, pin=False)
        sizes = StepPlan(total, world, rank, batch).batch_sizes
        out.append([b["y"].tolist() for b in loader.batches(sizes, pass_index)])
    return out


@pytest.mark.parametrize("world,buffer", [(1, None), (3, 5), (4, 1)])
def test_every_row_once_per_epoch_across_ranks_with_equal_steps(tmp_path, store, world, buffer):
    data = write_id_dataset(tmp_path, [10, 1, 12], row_group_size=4)  # 23 rows
    spec = train_spec(data, store, shuffle_buffer_size=buffer)
    for pass_index in (1, 2):
        ranks = epoch_ids(spec, world, 3, pass_index)
        assert len({len(batches) for batches in ranks}) == 1
        seen = sorted(i for batches in ranks for batch in batches for i in batch)
        assert seen == list(range(23))


def test_shuffled_order_is_seeded_reproducible_and_new_each_epoch(tmp_path, store):
    data = write_id_dataset(tmp_path, [30, 30], row_group_size=6)
    spec = train_spec(data, store, seed=7, shuffle_buffer_size=12)
    first = epoch_ids(spec, 2, 5, 1)
    assert epoch_ids(spec, 2, 5, 1) == first
    assert epoch_ids(spec, 2, 5, 2) != first
    assert epoch_ids(train_spec(data, store, seed=8, shuffle_buffer_size=12), 2, 5, 1) != first
    # each rank keeps its own rows: shuffling never moves rows across shards
    assert sorted(i for b in first[0] for i in b) == list(range(30))


def test_without_shuffle_rows_come_in_file_order(tmp_path, store):
    data = write_id_dataset(tmp_path, [7, 7], row_group_size=3)
    ranks = epoch_ids(train_spec(data, store, shuffle=False), 2, 3, 1)
    assert [i for b in ranks[0] for i in b] == list(range(7))
    assert [i for b in ranks[1] for i in b] == list(range(7, 14))
    assert ranks == epoch_ids(train_spec(data, store, shuffle=False), 2, 3, 2)


def test_a_pass_says_how_many_batches_are_left(tmp_path, store):
    data = write_id_dataset(tmp_path, [7, 7], row_group_size=3)
    loader = open_loader(train_spec(data, store), "train", 1, 0, pin=False)
    batches = loader.batches([4, 4, 4, 2], 1)
    left = [operator.length_hint(batches)]
    for _ in batches:
        left.append(operator.length_hint(batches))
    assert left == [4, 3, 2, 1, 0]


def test_validation_is_read_in_order_even_with_shuffle(tmp_path, store):
    data = write_id_dataset(tmp_path, [9], row_group_size=2, split="validation")
    loader = open_loader(train_spec(data, store, shuffle=True), "validation", 1, 0, pin=False)
    assert [b["y"].tolist() for b in loader.batches([4, 4, 1], 3)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8],
    ]


def test_the_shuffle_buffer_is_bounded():
    layout = Layout({"y": torch.empty(0, dtype=torch.int64)}, [ColumnSpec("y", "scalar", "int64")])
    chunks = [layout.assemble({"y": np.arange(i, i + 4)}) for i in range(0, 40, 4)]
    gen = torch.Generator().manual_seed(0)
    batches = list(
        buffered_batches(iter(chunks), [2] * 20, layout, [4] * 10, buffer_rows=10, generator=gen)
    )
    # the buffer fills to >= 10 rows (three chunks) before the first batch is drawn
    assert set(batches[0]["y"].tolist()) <= set(range(12))
    assert sorted(torch.cat([b["y"] for b in batches]).tolist()) == list(range(40))
    assert [b["y"].tolist() for b in batches] != [[i, i + 1] for i in range(0, 40, 2)]


@pytest.mark.parametrize("buffer", [1, 6, 10, 64])
def test_a_shuffled_pass_is_one_order_whatever_batch_sizes_cut_it(buffer):
    # the rest of a resized epoch reads a pass again in other sizes: same rows, same order
    layout = Layout({"y": torch.empty(0, dtype=torch.int64)}, [ColumnSpec("y", "scalar", "int64")])
    rows = [4, 1, 7, 4, 4, 3, 4, 4, 5, 4]  # 40

    def order(sizes):
        chunks, at = [], 0
        for n in rows:
            chunks.append(layout.assemble({"y": np.arange(at, at + n)}))
            at += n
        gen = torch.Generator().manual_seed(5)
        batches = buffered_batches(
            iter(chunks), sizes, layout, rows, buffer_rows=buffer, generator=gen
        )
        return [i for b in batches for i in b["y"].tolist()]

    expected = pass_order(rows, buffer, torch.Generator().manual_seed(5)).tolist()
    assert sorted(expected) == list(range(40))
    for sizes in ([1] * 40, [3] * 13 + [1], [40], [0, 17, 2, 0, 21], [9, 31], [25]):
        assert order(sizes) == expected[: sum(sizes)]


def test_in_memory_cache_reads_once_and_yields_the_same_batches(tmp_path, store):
    data = write_id_dataset(tmp_path, [20], row_group_size=5)
    cached = open_loader(train_spec(data, store, inmemory_cache_all=True), "train", 1, 0, False)
    streamed = open_loader(train_spec(data, store), "train", 1, 0, False)
    reads = []
    read = cached.read_chunks
    cached.read_chunks = lambda pieces: (reads.append(len(pieces)), read(pieces))[1]
    sizes = StepPlan(20, 1, 0, 6).batch_sizes
    for pass_index in (1, 2, 3):
        got = [b["y"].tolist() for b in cached.batches(sizes, pass_index)]
        assert got == [b["y"].tolist() for b in streamed.batches(sizes, pass_index)]
    assert reads == [4, 0, 0]
    # a transformation changing a batch in place must not corrupt the cache
    for batch in cached.batches(sizes, 4):
        edited = dict(batch)  # what a transformation_fn gets: views of the batch's rows
        edited["y"] += 1000
    assert sorted(i for b in cached.batches(sizes, 5) for i in b["y"].tolist()) == list(range(20))


def test_a_rank_without_rows_gets_empty_batches_with_row_shapes(tmp_path, store):
    data = write_id_dataset(tmp_path, [3], row_group_size=3)
    spec = train_spec(data, store)
    loader = open_loader(spec, "train", 4, 3, pin=False)
    (batch,) = loader.batches(StepPlan(3, 4, 3, 2).batch_sizes, 1)
    assert batch["x"].shape == (0, 2) and batch["y"].dtype == torch.int64


def test_asking_for_more_rows_than_the_shard_has_is_an_error(tmp_path, store):
    data = write_id_dataset(tmp_path, [3], row_group_size=3)
    loader = open_loader(train_spec(data, store), "train", 1, 0, pin=False)
    with pytest.raises(ValueError, match="loader: 4 rows asked of a shard of 3"):
        next(loader.batches([4], 1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_buffer_is_pinned_and_batches_copy_without_blocking(tmp_path, store):
    from spark_estimator.worker.data.batch import Batch

    data = write_id_dataset(tmp_path, [20], row_group_size=5)
    spec = train_spec(data, store, shuffle_buffer_size=8)
    loader = open_loader(spec, "train", 1, 0, pin=True)
    batches = list(loader.batches(StepPlan(20, 1, 0, 6).batch_sizes, 1))
    assert all(b["x"].is_pinned() and b["y"].is_pinned() for b in batches)
    on_gpu = Batch(batches[0], spec, torch.device("cuda:0"))
    torch.cuda.synchronize()
    assert on_gpu.inputs[0].is_cuda and torch.equal(on_gpu.labels[0].cpu(), batches[0]["y"])


def test_shuffled_batches_keep_the_order_earlier_versions_gave_for_a_seed(tmp_path, store):
    # the same seed must keep giving the same batches (runs resume and compare across
    # versions). Recorded when the buffer's refills became fixed by its size (issue 27):
    # rank 1's order changed then, as its refills had followed the batch sizes asked for
    data = write_id_dataset(tmp_path, [10, 1, 12], row_group_size=4)
    spec = train_spec(data, store, seed=3, shuffle_buffer_size=5)
    assert epoch_ids(spec, 2, 3, 1) == [
        [[0, 2, 4], [3, 5, 6], [10, 7, 9], [11, 8, 1]],
        [[14, 18, 16], [17, 12, 19], [22, 13, 21], [15, 20]],
    ]


def test_scalar_columns_of_one_dtype_are_one_row_major_block_cut_once(tmp_path, store):
    from tests.worker.data.test_device_shard import mixed_dataset

    spec = train_spec(mixed_dataset(tmp_path), store, seed=5, shuffle_buffer_size=8)
    loader = open_loader(spec, "train", 1, 0, pin=False)
    batches = list(loader.batches(StepPlan(23, 1, 0, 3).batch_sizes, 1))
    first = batches[0]
    assert [names for _, names in first.layout.groups] == [["a", "b"], ["y"]]
    (floats, ids), (x,) = first.blocks, first.others
    assert floats.shape == (3, 2) and ids.shape == (3, 1) and x.shape == (3, 3)
    # each scalar column is a view of its block's rows: a, b side by side in one row
    assert (
        torch.equal(first["a"], floats[:, 0]) and first["b"].data_ptr() == floats[0, 1].data_ptr()
    )
    assert (
        torch.allclose(first["b"], -first["a"]) and first["x"][:, 0].tolist() == first["y"].tolist()
    )
    # the batches of one refill are views of one buffer: cutting them made no copies
    storages = {b.blocks[0].untyped_storage().data_ptr() for b in batches[:2]}
    assert len(storages) == 1 and list(first) == ["a", "b", "x", "y"]


def test_a_piece_with_other_rows_than_planned_is_an_error():
    layout = Layout({"y": torch.empty(0, dtype=torch.int64)}, [ColumnSpec("y", "scalar", "int64")])
    chunks = [layout.assemble({"y": np.arange(4)}), layout.assemble({"y": np.arange(3)})]
    batches = buffered_batches(iter(chunks), [4, 4], layout, [4, 4], buffer_rows=8, generator=None)
    with pytest.raises(RuntimeError, match="the reader gave 3 rows for a piece of 4"):
        list(batches)
