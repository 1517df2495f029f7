"""The Horovod-style helpers: outside a task a clear RuntimeError, no torch.distributed error;
inside one, ``device_mesh()`` for FSDP2."""

import pytest
import torch
import torch.distributed as dist

from spark_estimator import distributed as sd
from spark_estimator import run

CALLS = {
    "rank": lambda: sd.rank(),
    "size": lambda: sd.size(),
    "local_rank": lambda: sd.local_rank(),
    "local_size": lambda: sd.local_size(),
    "device": lambda: sd.device(),
    "device_mesh": lambda: sd.device_mesh(),
    "allreduce number": lambda: sd.allreduce(1.0),
    "allreduce tensor": lambda: sd.allreduce(torch.ones(2), average=False),
    "broadcast_object": lambda: sd.broadcast_object({"a": 1}),
    "barrier": lambda: sd.barrier(),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_helpers_outside_a_task_raise_a_clear_error(name):
    with pytest.raises(RuntimeError, match="not inside a spark-estimator task"):
        CALLS[name]()


def shard_a_layer():
    """This rank's mesh, and its shard of a layer fully_shard splits over it."""
    from torch.distributed.fsdp import fully_shard

    mesh = sd.device_mesh()
    torch.manual_seed(0)  # the same full weight on every rank
    layer = torch.nn.Linear(3, 6)
    full = layer.weight.detach().clone()
    fully_shard(layer, mesh=mesh)
    return {
        "size": mesh.size(),
        "device_type": mesh.device_type,
        "cached": sd.device_mesh() is mesh,
        "job's group": mesh.get_group() is dist.group.WORLD,
        "full": full,
        "shard": layer.weight.to_local().detach().clone(),
    }


def test_device_mesh_spans_the_job_and_fully_shard_splits_a_weight_over_it(spark):
    results = run(shard_a_layer, num_proc=2, use_gpu=False, spark=spark)
    for r in results:
        assert (r["size"], r["device_type"], r["cached"], r["job's group"]) == (
            2,
            "cpu",
            True,
            True,
        )
    shards = [r["shard"] for r in results]
    assert [s.shape for s in shards] == [torch.Size([3, 3])] * 2  # half the rows on each rank
    assert torch.equal(torch.cat(shards), results[0]["full"])  # rank 0 the first half
