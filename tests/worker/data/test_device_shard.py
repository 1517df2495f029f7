"""A rank's shard held on its device (here the CPU), against the streaming loader."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from spark_estimator.shared.spec import ColumnSpec, DatasetInfo
from spark_estimator.worker.comm.ranks import RankInfo
from spark_estimator.worker.data.device_shard import DeviceShard, placement
from spark_estimator.worker.data.loader import ShardLoader, open_loader
from spark_estimator.worker.data.rank_data import RankData
from spark_estimator.worker.data.shards import StepPlan
from tests.worker.data.test_loader import train_spec

CPU = torch.device("cpu")


def mixed_dataset(root, file_rows=(9, 14), row_group_size=4) -> DatasetInfo:
    """Scalar float32 columns a and b, a 3-wide array x, an int64 label y (= the row id)."""
    files, start = [], 0
    (root / "train").mkdir(parents=True)
    for i, rows in enumerate(file_rows):
        ids = list(range(start, start + rows))
        start += rows
        table = pa.table(
            {
                "a": pa.array([v / 10 for v in ids], pa.float32()),
                "b": pa.array([-v / 10 for v in ids], pa.float32()),
                "x": pa.array([[v, v + 0.5, -v] for v in ids], pa.list_(pa.float32())),
                "y": pa.array(ids, pa.int64()),
            }
        )
        path = root / "train" / f"part-{i}.parquet"
        pq.write_table(table, path, row_group_size=row_group_size)
        meta = pq.ParquetFile(path).metadata
        groups = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        files.append((f"train/{path.name}", groups))
    scalar = [ColumnSpec("a", "scalar", "float32"), ColumnSpec("b", "scalar", "float32")]
    return DatasetInfo(
        path=str(root),
        features=[*scalar, ColumnSpec("x", "array", "float32")],
        labels=[ColumnSpec("y", "scalar", "int64")],
        files={"train": files},
        row_lengths={"x": 3},
    )


def passes(spec, world, rank, hold: bool, pass_indexes=(1, 2)):
    loader = open_loader(spec, "train", world, rank, pin=False, hold_on=CPU if hold else None)
    assert isinstance(loader, DeviceShard if hold else ShardLoader)
    sizes = StepPlan(spec.data.rows("train"), world, rank, 3).batch_sizes
    return [
        [{k: v.tolist() for k, v in b.items()} for b in loader.batches(sizes, p)]
        for p in pass_indexes
    ]


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("buffer", [None, 5, 1])  # None: the shard fits the buffer
def test_held_batches_are_the_streaming_batches(tmp_path, store, world, shuffle, buffer):
    data = mixed_dataset(tmp_path)
    spec = train_spec(data, store, seed=5, shuffle=shuffle, shuffle_buffer_size=buffer)
    for rank in range(world):
        held = passes(spec, world, rank, hold=True)
        assert held == passes(spec, world, rank, hold=False)
        ids = [sorted(i for batch in one_pass for i in batch["y"]) for one_pass in held]
        assert ids[0] == ids[1] and len(ids[0]) == len(set(ids[0]))  # every row once a pass
        if shuffle:
            assert held[0] != held[1]  # a new order each pass


def test_scalar_columns_of_one_dtype_are_one_block_and_batches_are_new_tensors(tmp_path, store):
    spec = train_spec(mixed_dataset(tmp_path), store, shuffle=False)
    shard = open_loader(spec, "train", 1, 0, pin=False, hold_on=CPU)
    block, names = shard.blocks[torch.float32]
    assert names == ["a", "b"] and block.shape == (2, 23) and set(shard.columns) == {"x"}
    assert shard.blocks[torch.int64][1] == ["y"]
    assert shard.nbytes == 23 * (4 + 4 + 3 * 4 + 8)
    first = next(shard.batches([5] * 4 + [3], 1))
    assert all(t.is_contiguous() for t in first.values())
    first["a"].add_(100.0), first["x"].mul_(0)  # a model editing its inputs in place
    again = next(shard.batches([5] * 4 + [3], 1))
    assert again["a"].tolist() == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert again["x"][1].tolist() == [1.0, 1.5, -1.0]


def test_placement_holds_what_fits_and_says_why_it_streams(tmp_path, store):
    data = mixed_dataset(tmp_path)
    rows = {"train": 23, "validation": 0}
    held, line = placement(train_spec(data, store), rows, CPU, local_size=2)
    assert held and line.startswith("held on cpu: 0.0 MiB within") and "/ 2 processes" in line
    cases = {
        "device_cache_fraction is 0": dict(device_cache_fraction=0.0),
        "over the budget": dict(device_cache_fraction=1e-12),
        "transformation_fn runs on every batch on the host": dict(transformation_fn=b"fn"),
    }
    for reason, options in cases.items():
        held, line = placement(train_spec(data, store, **options), rows, CPU, 1)
        assert not held and line.startswith("streaming: ") and reason in line
    data.row_lengths.clear()
    held, line = placement(train_spec(data, store), rows, CPU, 1)
    assert not held and "row size of column 'x' is not recorded" in line


def test_rank_data_falls_back_to_streaming_over_the_budget(tmp_path, store):
    data = mixed_dataset(tmp_path)
    info = RankInfo(0, 1, 0, 1, CPU)
    held = RankData(train_spec(data, store), info, lockstep=False)
    assert isinstance(held.train, DeviceShard) and isinstance(held.validation, DeviceShard)
    over = RankData(train_spec(data, store, device_cache_fraction=1e-12), info, lockstep=False)
    assert isinstance(over.train, ShardLoader) and over.placement.startswith("streaming")
