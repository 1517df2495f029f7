"""Batches on their way to the device: one copy per block of scalar columns."""

import torch

from spark_estimator.shared.spec import ColumnSpec
from spark_estimator.worker.data.batch import to_device
from spark_estimator.worker.data.loader import open_loader
from spark_estimator.worker.data.shards import StepPlan
from tests.worker.data.test_device_shard import mixed_dataset
from tests.worker.data.test_loader import train_spec

META = torch.device("meta")  # a device without memory: shows what would be copied


def test_a_loader_batch_crosses_as_one_block_per_dtype(tmp_path, store):
    data = mixed_dataset(tmp_path)
    loader = open_loader(train_spec(data, store), "train", 1, 0, pin=False)
    batch = next(loader.batches(StepPlan(23, 1, 0, 5).batch_sizes, 1))
    moved = to_device(batch, data.columns, META)
    assert [tuple(b.shape) for b in moved.blocks] == [(5, 2), (5, 1)]  # a and b; y
    assert [tuple(t.shape) for t in moved.others] == [(5, 3)]  # x
    assert all(t.device == META for t in moved.tensors())
    assert moved["b"].shape == (5,) and moved["b"].device == META


def test_a_transformed_batch_is_laid_out_in_blocks_with_its_values(tmp_path):
    columns = [
        ColumnSpec("a", "scalar", "float32"),
        ColumnSpec("b", "scalar", "float32"),
        ColumnSpec("y", "scalar", "int64"),
    ]
    plain = {"a": torch.arange(4.0), "b": -torch.arange(4.0), "y": torch.arange(4)}
    moved = to_device(plain, columns, torch.device("cpu"))
    assert [tuple(b.shape) for b in moved.blocks] == [(4, 2), (4, 1)]
    assert all(torch.equal(moved[k], v) for k, v in plain.items())
    plain["a"].add_(1)  # a copy: the transformation's tensors are not the batch's
    assert moved["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
