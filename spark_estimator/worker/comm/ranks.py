"""Executor: where a task sits in its job (``RankInfo``): its rank, its local and cross
ranks, worked out from the host of every rank (Horovod's local and cross communicators),
and whether every host runs as many ranks."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RankInfo:
    """Where this task sits in the job: its ranks, the device it pinned, and, when it fell
    back to CPU although ``use_gpu`` asked for a GPU, why (``device_note``); the GPU
    addresses Spark assigned the task (``gpu_addresses``: also where it fell back)."""

    rank: int
    world_size: int
    local_rank: int  # rank among the job's tasks on this host
    local_size: int
    device: torch.device
    device_note: str | None = None
    cross_rank: int = 0  # rank among the job's tasks with this local rank (hvd.cross_rank)
    cross_size: int = 1
    gpu_addresses: tuple[str, ...] = ()  # TaskContext.resources()["gpu"].addresses
    homogeneous: bool = True  # every host runs as many of the job's ranks (hvd.is_homogeneous)


def local_ranks(hosts: Sequence[str], rank: int) -> tuple[int, int]:
    """(local rank, local size) of ``rank`` given the host of every rank."""
    same = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    return same.index(rank), len(same)


def cross_ranks(hosts: Sequence[str], rank: int) -> tuple[int, int]:
    """(cross rank, cross size) of ``rank`` given the host of every rank: its place among
    the ranks with the same local rank (Horovod's cross communicator; one rank per host)."""
    mine = local_ranks(hosts, rank)[0]
    same = [r for r in range(len(hosts)) if local_ranks(hosts, r)[0] == mine]
    return same.index(rank), len(same)


def homogeneous(hosts: Sequence[str]) -> bool:
    """Whether every host runs as many of the ranks (``hosts``: the host of every rank)."""
    return len(set(Counter(hosts).values())) == 1
