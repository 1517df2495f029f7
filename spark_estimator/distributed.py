"""Executor: Horovod-style helpers for a function run by ``spark_estimator.run``.

    from spark_estimator import distributed as sd
    sd.rank(), sd.size(), sd.local_rank(), sd.local_size(), sd.device()
    sd.allreduce(loss), sd.broadcast_object(config), sd.barrier()
    sd.device_mesh()   # for FSDP2's fully_shard, DTensor

They read the running task's process group; outside one each raises a RuntimeError.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .worker.comm.ranks import RankInfo
from .worker.comm.rendezvous import current_rank_info

_mesh: tuple[RankInfo, DeviceMesh] | None = None  # the running task's, made on first use


def rank() -> int:
    """This process's rank in the job.

    Returns
    -------
    int
        0 .. ``size() - 1``.

    Raises
    ------
    RuntimeError
        Outside a task of ``spark_estimator.run`` (or of a fit's training loop).
    """
    return current_rank_info().rank


def size() -> int:
    """The number of processes in the job.

    Returns
    -------
    int
        The job's number of ranks.

    Raises
    ------
    RuntimeError
        Outside a task of ``spark_estimator.run`` (or of a fit's training loop).
    """
    return current_rank_info().world_size


def local_rank() -> int:
    """This process's rank among the job's processes on the same host.

    Returns
    -------
    int
        0 .. ``local_size() - 1``.

    Raises
    ------
    RuntimeError
        Outside a task of ``spark_estimator.run`` (or of a fit's training loop).
    """
    return current_rank_info().local_rank


def local_size() -> int:
    """The number of the job's processes on this host.

    Returns
    -------
    int
        How many of the job's ranks run on this host.
    """
    return current_rank_info().local_size


def device() -> torch.device:
    """The device this task pinned: the GPU Spark assigned it, or the CPU.

    Returns
    -------
    torch.device
        ``cuda:<index>`` of the task's GPU, or ``cpu``.
    """
    return current_rank_info().device


def device_mesh() -> DeviceMesh:
    """A 1-D DeviceMesh over every rank of the job, for FSDP2 and DTensor.

    It spans the job's process group (no new group is formed) and is made once per task
    (a collective: call it on every rank): a later task in the same (reused) Python worker,
    in a new group, gets a new mesh, named anew (see ``worker.comm.fsdp.mesh``).

    Returns
    -------
    torch.distributed.device_mesh.DeviceMesh
        A mesh of ``device()``'s type ("cuda" or "cpu"): what
        ``fully_shard(module, mesh=...)`` (FSDP2) and DTensor shard over.

    Raises
    ------
    RuntimeError
        Outside a task of ``spark_estimator.run`` (or of a fit's training loop).

    Examples
    --------
    >>> from torch.distributed.fsdp import fully_shard
    >>> from spark_estimator import distributed as sd
    >>> fully_shard(model, mesh=sd.device_mesh())                       # doctest: +SKIP
    """
    global _mesh
    info = current_rank_info()
    if _mesh is None or _mesh[0] is not info:
        name = [f"job-{uuid.uuid4().hex[:12]}"]
        dist.broadcast_object_list(name, src=0)
        from .worker.comm import fsdp  # torch's FSDP: imported where it is used

        _mesh = info, fsdp.mesh(info, name[0])
    return _mesh[1]


def _sum(tensor: torch.Tensor) -> torch.Tensor:
    """The elementwise sum over ranks of ``tensor`` (a copy on the pinned device; NCCL
    only reduces CUDA tensors), back on ``tensor``'s device."""
    work = tensor.detach().to(current_rank_info().device, copy=True).contiguous()
    dist.all_reduce(work, op=dist.ReduceOp.SUM)
    return work.to(tensor.device)


def allreduce(value, average: bool = True):
    """The sum over ranks of ``value``, divided by ``size()`` when ``average``.

    A collective: every rank calls it, with values of the same kind and shape.

    Parameters
    ----------
    value : torch.Tensor, int, float or numpy scalar
        A tensor (on the CPU or the task's device), a Python int or float, or a numpy
        integer or float scalar. It is not modified.
    average : bool, default True
        Divide the sum by ``size()``.

    Returns
    -------
    torch.Tensor, int, float or numpy scalar
        The result, of the same kind as ``value`` (an integer average is a float); a tensor
        comes back on ``value``'s device.

    Raises
    ------
    TypeError
        ``value`` is of another type.
    RuntimeError
        Outside a task of ``spark_estimator.run`` (or of a fit's training loop).

    Examples
    --------
    >>> from spark_estimator import distributed as sd
    >>> mean_loss = sd.allreduce(loss.detach())                         # doctest: +SKIP
    >>> total = sd.allreduce(len(batch), average=False)                 # doctest: +SKIP
    """
    world = size()
    if isinstance(value, torch.Tensor):
        total = _sum(value)
        return total / world if average else total
    if isinstance(value, (np.integer, np.floating)):
        total = _sum(torch.from_numpy(np.asarray(value))).numpy()[()]
        return total / world if average else total
    if isinstance(value, (int, float)):
        dtype = torch.float64 if isinstance(value, float) else torch.int64
        total = _sum(torch.tensor(value, dtype=dtype)).item()
        return total / world if average else total
    raise TypeError(
        f"allreduce: expected a tensor, a Python int or float or a numpy scalar, got "
        f"{type(value).__name__}"
    )


def broadcast_object(obj: Any, root: int = 0) -> Any:
    """``root``'s ``obj`` on every rank.

    A collective: every rank calls it.

    Parameters
    ----------
    obj : object
        On ``root``, any picklable object; the other ranks pass anything (it is ignored).
    root : int, default 0
        The rank whose ``obj`` is sent.

    Returns
    -------
    object
        ``root``'s ``obj``, unpickled on every rank.

    Raises
    ------
    ValueError
        ``root`` is not a rank of the job.
    RuntimeError
        Outside a task of ``spark_estimator.run`` (or of a fit's training loop).

    Examples
    --------
    >>> from spark_estimator import distributed as sd
    >>> config = sd.broadcast_object(read_config() if sd.rank() == 0 else None)  # doctest: +SKIP
    """
    info = current_rank_info()
    if not 0 <= root < info.world_size:
        raise ValueError(f"root: must be a rank in [0, {info.world_size}), got {root}")
    holder = [obj if info.rank == root else None]
    dist.broadcast_object_list(holder, src=root, device=info.device)
    return holder[0]


def barrier() -> None:
    """Wait until every rank has reached this call."""
    info = current_rank_info()
    if info.device.type == "cuda":
        dist.barrier(device_ids=[info.device.index])
    else:
        dist.barrier()
