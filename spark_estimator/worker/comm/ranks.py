"""Executor: where a task sits in its job (``RankInfo``): its rank, its local and cross
ranks, worked out from the host of every rank (Horovod's local and cross communicators),
its host's index among the job's hosts (torchrun's node rank), and whether every host runs
as many ranks.

A fit's rank is its task's (Spark's partition id). ``run`` numbers its ranks host by host
instead (``ranks_by_host``), as torchrun does: Spark hands a job's tasks out round-robin
over the executors, so tasks 0 and 2 may share a host and task 1 run on another, while a
Lightning ``Trainer(num_nodes=n)`` (and any script that takes ``RANK // LOCAL_WORLD_SIZE``
for its host) counts on the ranks of one host being consecutive. Every task works the
numbering out alike from the barrier context's list of task addresses, so each rank's
identity is the same on all of them; task 0 stays rank 0, the one that serves the job's
TCPStore (``meeting.meet``)."""

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
    node_rank: int = 0  # its host's index among the job's hosts (torchrun's GROUP_RANK)
    num_nodes: int = 1  # the job's hosts (GROUP_WORLD_SIZE)


def task_hosts(ctx) -> list[str]:
    """The host of each task of the barrier job (``ctx``: its BarrierTaskContext), by task."""
    return [info.address.rsplit(":", 1)[0] for info in ctx.getTaskInfos()]


def job_ranks(ctx, by_host: bool) -> tuple[int, list[str]]:
    """This task's rank and the host of every rank: ranks numbered as the tasks are, or
    host by host (``ranks_by_host``) with ``by_host``."""
    hosts, task = task_hosts(ctx), ctx.partitionId()
    if not by_host:
        return task, hosts
    order = ranks_by_host(hosts)
    return order.index(task), [hosts[t] for t in order]


def ranks_by_host(hosts: Sequence[str]) -> list[int]:
    """The task of each rank when ranks are numbered host by host (``hosts``: the host of
    each task): the hosts in the order of their first task, each host's tasks in their
    order. Task 0 stays rank 0."""
    first: dict[str, int] = {}
    for host in hosts:
        first.setdefault(host, len(first))
    return sorted(range(len(hosts)), key=lambda task: (first[hosts[task]], task))


def node_ranks(hosts: Sequence[str], rank: int) -> tuple[int, int]:
    """(node rank, number of nodes) of ``rank`` given the host of every rank: the index of
    its host among the hosts in the order of their first rank, and how many hosts there
    are (torchrun's ``GROUP_RANK`` and ``GROUP_WORLD_SIZE``)."""
    order = list(dict.fromkeys(hosts))
    return order.index(hosts[rank]), len(order)


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
