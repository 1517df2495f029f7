import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from spark_estimator.spec import ColumnSpec, DatasetInfo
from spark_estimator.worker.loader import (
    TrainBatches,
    eval_batches,
    read_shard,
    shard_bounds,
    split_sizes,
)


@pytest.mark.parametrize("rows,world", [(10, 3), (9, 2), (1, 4), (0, 2), (1000, 8)])
def test_shards_partition_rows_evenly(rows, world):
    bounds = [shard_bounds(rows, world, r) for r in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == rows
    assert all(bounds[r][1] == bounds[r + 1][0] for r in range(world - 1))
    sizes = [e - s for s, e in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_split_sizes():
    assert split_sizes(5, 2) == [3, 2] and split_sizes(2, 3) == [1, 1, 0]


@pytest.mark.parametrize("rows,world,batch", [(9, 2, 4), (10, 3, 2), (101, 4, 8), (3, 2, 1)])
def test_every_rank_takes_the_same_steps_and_every_row_is_used_once(rows, world, batch):
    ranks = [TrainBatches(rows, world, r, batch, seed=1) for r in range(world)]
    assert len({b.steps for b in ranks}) == 1
    seen = []
    for b in ranks:
        start, _ = shard_bounds(rows, world, b.rank)
        steps = list(b.epoch(1))
        assert len(steps) == b.steps
        assert all(len(index) <= batch for index, _ in steps)
        seen += [start + int(i) for index, _ in steps for i in index]
    assert sorted(seen) == list(range(rows))


def test_loss_weights_make_the_ddp_average_an_exact_mean():
    rows, world, batch = 9, 2, 4
    ranks = [TrainBatches(rows, world, r, batch, seed=0) for r in range(world)]
    for step in zip(*(b.epoch(1) for b in ranks)):
        # DDP averages over ranks: sum_r weight_r * n_r-mean / world == rows-weighted mean
        total = sum(len(index) for index, _ in step)
        for index, weight in step:
            assert weight == pytest.approx(len(index) * world / total)


def test_shuffle_is_seeded_and_changes_per_epoch():
    a, b = TrainBatches(50, 1, 0, 50, seed=3), TrainBatches(50, 1, 0, 50, seed=3)
    first = next(a.epoch(1))[0]
    assert torch.equal(first, next(b.epoch(1))[0])
    assert not torch.equal(first, next(a.epoch(2))[0])
    assert not torch.equal(first, next(TrainBatches(50, 1, 0, 50, seed=4).epoch(1))[0])


def test_eval_batches_cover_rows_in_order():
    assert [b.tolist() for b in eval_batches(5, 2)] == [[0, 1], [2, 3], [4]]


def test_read_shard_reads_only_its_rows_across_files_and_row_groups(tmp_path, store):
    root = tmp_path / "data"
    (root / "train").mkdir(parents=True)
    ids = list(range(23))
    files = []
    for i, chunk in enumerate([ids[:10], ids[10:11], ids[11:]]):
        table = pa.table({"x": [[float(v), -float(v)] for v in chunk], "y": chunk})
        pq.write_table(table, root / "train" / f"part-{i}.parquet", row_group_size=4)
        meta = pq.ParquetFile(root / "train" / f"part-{i}.parquet").metadata
        groups = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        files.append((f"train/part-{i}.parquet", groups))
    data = DatasetInfo(
        path=str(root),
        features=[ColumnSpec("x", "array", False)],
        labels=[ColumnSpec("y", "scalar", True)],
        files={"train": files},
    )
    seen = []
    for rank in range(3):
        shard = read_shard(store, data, "train", 3, rank)
        assert shard["x"].shape[1] == 2 and shard["y"].dtype == torch.int64
        assert torch.equal(shard["x"][:, 0].long(), shard["y"])
        start, end = shard_bounds(23, 3, rank)
        assert shard["y"].tolist() == list(range(start, end))
        seen += shard["y"].tolist()
    assert seen == ids
    empty = read_shard(store, data, "validation", 3, 0)
    assert len(empty["x"]) == 0
