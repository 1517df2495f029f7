"""Executor: Horovod's process sets, subsets of the job's ranks that run collectives together.

    even = hvd.add_process_set([0, 2])          # on every rank, in the same order
    if even.included():
        hvd.allreduce(x, process_set=even)      # averaged over ranks 0 and 2

Each set is a torch.distributed subgroup (``dist.new_group``), which every rank of the job
forms together: as Horovod requires, every process calls ``add_process_set`` (and
``hvd.init(process_sets=...)``, ``remove_process_set``) with the same sets in the same
order. ``global_process_set`` (id 0) is the whole job. A set belongs to the task that
added it: PySpark reuses its Python workers, and a later task starts with the global set
only. ``scope()`` is what the collectives use: the set's group, size and this rank's rank
in it, or Horovod's error where this rank is not in the set.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..worker.comm.ranks import RankInfo
from .core import is_initialized, rank_info


class ProcessSet:
    """A set of the job's ranks (global ranks, kept sorted) that run collectives together.
    ``process_set_id`` is None until the set is added (``add_process_set`` or
    ``hvd.init(process_sets=...)``); ``size()``, ``rank()`` and ``included()`` are None
    until then, as Horovod's."""

    process_set_id: int | None = None
    ranks: list[int] | None = None

    def __init__(self, ranks: Iterable[int]):
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
            raise ValueError(f"ranks: expected a list of ranks (ints), got {ranks!r}")
        ranks = sorted(ranks)
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"ranks: expected a list of ranks (ints), got {ranks!r}")
        self.ranks = ranks
        self._task: RankInfo | None = None  # the task that added it

    def size(self) -> int | None:
        """The number of ranks in the set."""
        return None if self.process_set_id is None else len(self._members())

    def rank(self) -> int | None:
        """This process's rank within the set (0 .. size() - 1; for the result of an
        ``allgather``): ValueError where it is not in the set, as Horovod's. Collectives'
        ``root_rank`` is a global rank (``hvd.rank()``) all the same."""
        if self.process_set_id is None:
            return None
        members = self._members()
        if rank_info().rank not in members:
            raise ValueError(f"Process is not part of provided process set {self}.")
        return members.index(rank_info().rank)

    def included(self) -> bool | None:
        """Whether this process is in the set."""
        return None if self.process_set_id is None else rank_info().rank in self._members()

    def _members(self) -> list[int]:
        if self.process_set_id == 0:
            return list(range(rank_info().world_size))
        _registered(self)
        return self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


@dataclass(frozen=True)
class Scope:
    """Where a collective runs: the set's torch group (None: the whole job), its ranks,
    its size and this process's rank in it."""

    group: Any
    ranks: list[int]
    size: int
    rank: int

    @property
    def is_global(self) -> bool:
        return self.group is None


_task: RankInfo | None = None  # the task whose sets _groups holds
_groups: dict[int, Any] = {}  # process_set_id -> its torch group (absent where not a member)
_sets: dict[int, ProcessSet] = {}
_next_id = 1


def setup(process_sets: Iterable[ProcessSet] | None) -> None:
    """``hvd.init``: start this task's table (a new task starts with the global set only),
    then add ``process_sets`` in order."""
    global _task, _next_id
    info = rank_info()
    if _task is not info:
        _task, _next_id = info, 1
        _groups.clear()
        _sets.clear()
    global_process_set.ranks = list(range(info.world_size))
    if process_sets is None:
        return
    if isinstance(process_sets, ProcessSet) or not isinstance(process_sets, Iterable):
        raise ValueError(f"process_sets: expected a list of hvd.ProcessSet, got {process_sets!r}")
    for ps in process_sets:
        if not isinstance(ps, ProcessSet):
            raise ValueError(f"process_sets: expected hvd.ProcessSet items, got {ps!r}")
        if ps.process_set_id != 0:
            add_process_set(ps)


def add_process_set(process_set: ProcessSet | Iterable[int]) -> ProcessSet:
    """Add a set of ranks that run collectives together, as a torch.distributed subgroup.

    A collective: every process of the job calls it, with the same sets in the same order,
    members of the set or not. The set belongs to the running task (a later task starts
    with the global set only).

    Parameters
    ----------
    process_set : hvd.ProcessSet or list of int
        The set's global ranks: distinct ranks of the job. A set of the same ranks as one
        added before (or of every rank: the global set) is refused.

    Returns
    -------
    hvd.ProcessSet
        The set, now with its ``process_set_id``, to pass as ``process_set=`` to the
        collectives and ``DistributedOptimizer``.

    Raises
    ------
    ValueError
        Ranks outside the job or repeated, a duplicate set, a set added already; before
        ``hvd.init()``.

    Examples
    --------
    >>> even = hvd.add_process_set([0, 2])                              # doctest: +SKIP
    >>> if even.included():                                             # doctest: +SKIP
    ...     hvd.allreduce(x, process_set=even)
    """
    global _next_id
    info = rank_info()
    if _task is not info:
        setup(None)
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None and ps._task is info:
        raise ValueError(f"process_set: {ps} was added already")
    if not ps.ranks or any(not 0 <= r < info.world_size for r in ps.ranks):
        raise ValueError(
            f"process_set: ranks must be distinct ranks in [0, {info.world_size}), got {ps.ranks}"
        )
    if len(set(ps.ranks)) != len(ps.ranks):
        raise ValueError(f"process_set: ranks must be distinct, got {ps.ranks}")
    existing = [s for s in [global_process_set, *_sets.values()] if s.ranks == ps.ranks]
    if existing:
        raise ValueError(f"process_set: a duplicate of the process set {existing[0]}")
    group = dist.new_group(ps.ranks, timeout=_timeout(info))  # a collective of every rank
    ps.process_set_id, ps._task = _next_id, info
    _next_id += 1
    _sets[ps.process_set_id] = ps
    if info.rank in ps.ranks:
        _groups[ps.process_set_id] = group
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Remove an added set (every process calls it): its ``process_set_id`` becomes None.
    False for the global set or a set not added (in this task), as Horovod's."""
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set: expected an hvd.ProcessSet, got {process_set!r}")
    rank_info()
    if process_set.process_set_id in (None, 0) or _sets.get(process_set.process_set_id) is not (
        process_set
    ):
        return False
    group = _groups.pop(process_set.process_set_id, None)
    del _sets[process_set.process_set_id]
    process_set.process_set_id, process_set._task = None, None
    if group is not None:
        dist.destroy_process_group(group)
    return True


def scope(process_set: ProcessSet | None, op: str) -> Scope:
    """The group ``op`` (a collective's name) runs on; ValueError where this process is
    not in ``process_set``, as Horovod's (``Allreduce: Rank 2 is not a member of the
    provided process set.``)."""
    info = rank_info()
    if process_set is None or process_set is global_process_set:
        return Scope(None, list(range(info.world_size)), info.world_size, info.rank)
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set: expected an hvd.ProcessSet, got {process_set!r}")
    if process_set.process_set_id == 0:
        return Scope(None, list(range(info.world_size)), info.world_size, info.rank)
    _registered(process_set)
    if info.rank not in process_set.ranks:
        raise ValueError(
            f"{op[:1].upper()}{op[1:]}: Rank {info.rank} is not a member of the provided process "
            f"set {process_set}."
        )
    group = _groups[process_set.process_set_id]
    return Scope(group, process_set.ranks, len(process_set.ranks), process_set.rank())


def _registered(ps: ProcessSet) -> None:
    if ps.process_set_id is None:
        raise ValueError(
            f"process_set: {ps} has not been added: call hvd.add_process_set() (or pass it "
            "to hvd.init(process_sets=...)) on every rank first"
        )
    if ps._task is not _task or not is_initialized() or _sets.get(ps.process_set_id) is not ps:
        raise ValueError(f"process_set: {ps} was added in an earlier task or removed: add it again")


def _timeout(info: RankInfo):
    """The job's group's timeout (collective_timeout), for the subgroups too."""
    try:
        default = dist.distributed_c10d._get_default_group()
        return default._get_backend(info.device).options._timeout
    except (AttributeError, RuntimeError):
        return None
