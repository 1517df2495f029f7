"""Executor: ``hvd.init()`` and the queries of where this process sits in the job.

``init()`` marks this process initialised for the running task's process group (forming
one first with ``rendezvous.init_default_group`` when there is none, as for a script run
outside ``run(fn)``; the mark is ``core.mark_initialized``'s). The mark belongs to that
group: when the task ends, or after ``shutdown()``, every query raises until ``init()`` is
called again (PySpark reuses its Python workers, so a mark left by an earlier task must
not count).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..worker.comm import rendezvous
from . import core
from .core import is_initialized as is_initialized  # hvd.is_initialized
from .core import rank_info
from .process_sets import setup as setup_process_sets


def init(process_sets=None) -> None:
    """Join the job: mark this process initialised for the running task's process group.

    A no-op for the group where the task already formed it (``run(fn)``); else the default
    group is formed first: in the task of a script run by ``run``, the job's group, from
    torchrun's variables; outside any Spark task, a group of one process (rank 0 of 1), so
    that a script run with plain ``python`` runs as a job of size 1. Call it in every
    process before any other ``hvd`` call; again after ``shutdown()``, or in a later task.

    Parameters
    ----------
    process_sets : list of hvd.ProcessSet, optional
        Process sets to add, as ``add_process_set`` would; every rank passes the same list.

    Raises
    ------
    ValueError
        ``process_sets`` is not a list of ``hvd.ProcessSet``, or holds a set that cannot be
        added (see ``add_process_set``).
    RuntimeError
        The job's process group was destroyed inside a function run by ``run``: it cannot
        be formed again there.

    Examples
    --------
    >>> import spark_estimator.horovod as hvd
    >>> hvd.init()                                                      # doctest: +SKIP
    >>> print(f"rank {hvd.rank()} of {hvd.size()}")                     # doctest: +SKIP
    """
    if not dist.is_initialized():
        rendezvous.init_default_group()
    core.mark_initialized(rendezvous.current_rank_info())
    setup_process_sets(process_sets)


def shutdown() -> None:
    """Leave: the queries and collectives raise until ``init()`` is called again.

    The process group itself belongs to the task and is closed when the task ends.
    """
    core.mark_initialized(None)


def rank() -> int:
    """This process's rank in the job.

    Returns
    -------
    int
        0 .. ``size() - 1``.

    Raises
    ------
    ValueError
        Before ``hvd.init()`` in this task, as Horovod's queries raise.
    """
    return rank_info().rank


def size() -> int:
    """The number of processes in the job.

    Returns
    -------
    int
        The job's number of ranks.

    Raises
    ------
    ValueError
        Before ``hvd.init()`` in this task, as Horovod's queries raise.
    """
    return rank_info().world_size


def local_rank() -> int:
    """This process's rank among the job's processes on its host.

    Returns
    -------
    int
        0 .. ``local_size() - 1``.

    Raises
    ------
    ValueError
        Before ``hvd.init()`` in this task, as Horovod's queries raise.
    """
    return rank_info().local_rank


def local_size() -> int:
    """The number of the job's processes on this host."""
    return rank_info().local_size


def cross_rank() -> int:
    """This process's rank among the processes with its local rank (one per host): the
    rank of its host, for hosts with the same number of processes."""
    return rank_info().cross_rank


def cross_size() -> int:
    """The number of processes with this process's local rank: the number of hosts, for
    hosts with the same number of processes."""
    return rank_info().cross_size


def is_homogeneous() -> bool:
    """Whether every host runs the same number of the job's ranks."""
    return rank_info().homogeneous


def nccl_built() -> int:
    """NCCL's version code (``major * 10000 + minor * 100 + patch``, Horovod's
    ``NCCL_VERSION_CODE``) where torch.distributed has the NCCL backend (used for GPU
    ranks) and CUDA; 0 without: an int, as Horovod's, which scripts test and compare."""
    if not (dist.is_nccl_available() and torch.cuda.is_available()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()[:3]
    return major * 10000 + minor * 100 + patch


def gloo_built() -> bool:
    """Whether torch.distributed has the gloo backend (used for CPU ranks)."""
    return dist.is_gloo_available()


def mpi_built() -> bool:
    """Whether torch.distributed has the MPI backend (never used by this package)."""
    return dist.is_mpi_available()


def cuda_built() -> bool:
    """Whether torch was built with CUDA (GPU ranks use NCCL)."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """Whether torch was built with ROCm."""
    return torch.version.hip is not None


def ddl_built() -> bool:
    """False: IBM DDL is never used (the collectives are torch.distributed's)."""
    return False


def ccl_built() -> bool:
    """False: Intel oneCCL is never used (the collectives are torch.distributed's)."""
    return False


def mpi_enabled() -> bool:
    """False: the job is never run by MPI (Spark starts its processes)."""
    return False


def gloo_enabled() -> bool:
    """True: Horovod's non-MPI mode, the one that matches a job started by Spark, whose
    processes meet through the job's store (their collectives: gloo on CPU, NCCL on GPU)."""
    return True


def mpi_threads_supported() -> bool:
    """Raises ValueError, as Horovod does where MPI is not enabled (never, here)."""
    raise ValueError(
        "Horovod MPI is not enabled: spark_estimator.horovod runs without MPI "
        "(hvd.mpi_enabled() is False)"
    )
