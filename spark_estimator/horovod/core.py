"""Executor: the ground floor of ``spark_estimator.horovod``, which every other module of it
builds on and which imports none of them: whether ``hvd.init()`` was called for the
running task's process group and that task's ``RankInfo``, and the reduce ops.

``init()`` marks this process initialised for the running task's process group
(``mark_initialized``). The mark belongs to that group: when the task ends, or after
``shutdown()``, ``rank_info()`` raises until ``init()`` is called again (PySpark reuses its
Python workers, so a mark left by an earlier task must not count).
"""

from __future__ import annotations

from enum import IntEnum

import torch.distributed as dist

from ..worker.comm import rendezvous
from ..worker.comm.ranks import RankInfo

_initialized_for: RankInfo | None = None


def mark_initialized(info: RankInfo | None) -> None:
    """``init()``: this process is initialised for the task of ``info``; ``shutdown()``:
    None, for no task."""
    global _initialized_for
    _initialized_for = info


def is_initialized() -> bool:
    """Whether ``init()`` was called for the process group this process is in now."""
    if _initialized_for is None or not dist.is_initialized():
        return False
    try:
        return rendezvous.current_rank_info() is _initialized_for
    except RuntimeError:
        return False


def rank_info() -> RankInfo:
    """This process's RankInfo; ValueError before ``init()``, as Horovod's queries raise."""
    if not is_initialized():
        raise ValueError(
            "spark_estimator.horovod is not initialized: call hvd.init() first (in every "
            "process, before any other hvd call)"
        )
    return _initialized_for


class ReduceOp(IntEnum):
    """How ``allreduce`` combines the ranks' tensors (Horovod's numbering, which the control
    rounds of ``hvd.join()`` carry too)."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average, Sum, Adasum = ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM
Min, Max, Product = ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT

# torch.distributed's op of each (Adasum has none: adasum_allreduce_ combines the tensors)
TORCH_OPS = {
    Average: dist.ReduceOp.SUM,  # then divided by the size
    Sum: dist.ReduceOp.SUM,
    Min: dist.ReduceOp.MIN,
    Max: dist.ReduceOp.MAX,
    Product: dist.ReduceOp.PRODUCT,
}


def reduce_op(op, average: bool | None = None) -> ReduceOp:
    """The op Horovod's ``op`` and older ``average`` arguments ask for (default Average)."""
    if op is not None and average is not None:
        raise ValueError("op and average: give one of them (average is the older form of op)")
    if average is not None:
        return Average if average else Sum
    if op is None:
        return Average
    try:
        return ReduceOp(op)
    except ValueError:
        names = ", ".join(f"hvd.{o.name.title()}" for o in ReduceOp)
        raise ValueError(f"op: expected one of {names}, got {op!r}") from None
