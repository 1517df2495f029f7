"""hvd.init() and the queries: the running task's ranks, and Horovod's error before init."""

import pytest
import torch
import torch.distributed as dist

import spark_estimator.horovod as hvd

BEFORE_INIT = {
    "rank": lambda: hvd.rank(),
    "size": lambda: hvd.size(),
    "local_rank": lambda: hvd.local_rank(),
    "local_size": lambda: hvd.local_size(),
    "cross_rank": lambda: hvd.cross_rank(),
    "cross_size": lambda: hvd.cross_size(),
    "is_homogeneous": lambda: hvd.is_homogeneous(),
    "allreduce": lambda: hvd.allreduce(torch.ones(2)),
    "allgather": lambda: hvd.allgather(torch.ones(2)),
    "broadcast": lambda: hvd.broadcast(torch.ones(2), 0),
    "broadcast_object": lambda: hvd.broadcast_object(1),
    "allgather_object": lambda: hvd.allgather_object(1),
    "barrier": lambda: hvd.barrier(),
    "join": lambda: hvd.join(),
    "add_process_set": lambda: hvd.add_process_set([0]),
    "allreduce in a set": lambda: hvd.allreduce(torch.ones(1), process_set=hvd.ProcessSet([0])),
    "DistributedOptimizer": lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    ),
}


@pytest.mark.parametrize("name", list(BEFORE_INIT))
def test_every_call_before_init_raises_horovods_error(name, one_rank):
    assert not hvd.is_initialized()
    with pytest.raises(ValueError, match=r"not initialized: call hvd.init\(\) first"):
        BEFORE_INIT[name]()


def test_init_joins_the_tasks_group_until_shutdown_or_the_tasks_end(one_rank):
    hvd.init()  # the task formed the group: nothing more to form
    assert hvd.is_initialized()
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (0, 1, 0, 1)
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
    assert hvd.is_homogeneous() is True
    hvd.shutdown()
    assert not hvd.is_initialized() and dist.is_initialized()
    with pytest.raises(ValueError, match="not initialized"):
        hvd.rank()
    hvd.init()
    assert hvd.size() == 1


def test_an_init_of_an_earlier_task_does_not_count_in_the_next(one_rank):
    """PySpark reuses Python workers: the mark belongs to the group it was made in."""
    hvd.init()
    from spark_estimator.worker.comm import rendezvous
    from spark_estimator.worker.comm.ranks import RankInfo

    with pytest.MonkeyPatch.context() as patch:  # the next task's group
        patch.setattr(rendezvous, "_current", RankInfo(0, 1, 0, 1, one_rank.device))
        assert not hvd.is_initialized()


def test_built_backends_are_torch_distributeds():
    assert hvd.gloo_built() is True
    assert hvd.mpi_built() == dist.is_mpi_available()


def test_nccl_built_is_an_int_as_horovods_its_version_code_or_0():
    """Scripts write `if hvd.nccl_built():` and compare it with numbers (Horovod: NCCL's
    NCCL_VERSION_CODE, 0 without NCCL)."""
    built = hvd.nccl_built()
    assert type(built) is int
    if dist.is_nccl_available() and torch.cuda.is_available():
        major, minor, patch = torch.cuda.nccl.version()
        assert built == major * 10000 + minor * 100 + patch
    else:
        assert built == 0


def test_the_capability_queries_a_script_branches_on():
    assert hvd.cuda_built() is (torch.version.cuda is not None)
    assert hvd.rocm_built() is (torch.version.hip is not None)
    assert hvd.ddl_built() is False and hvd.ccl_built() is False  # never used
    assert hvd.mpi_enabled() is False  # never run by MPI
    assert hvd.gloo_enabled() is True  # Horovod's non-MPI mode
    with pytest.raises(ValueError, match="MPI is not enabled"):  # as Horovod without MPI
        hvd.mpi_threads_supported()
