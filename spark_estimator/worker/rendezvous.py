"""Executor: pin the device Spark assigned, join the job's torch.distributed process group.

Rank 0 starts a TCPStore on an OS-chosen port (bound before anyone is told of it, so no
other process can take the port in between) and shares the address through the barrier
context's ``allGather``; every rank then joins one process group (gloo on CPU, NCCL on GPU).
When the block ends normally every rank waits for the others before leaving; when it
raises, the first failing rank's error is the one Spark reports (see ``_first_failure``).
The group is destroyed when the task ends, failed or not, because PySpark reuses workers.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT = timedelta(minutes=10)
LATER_FAILURE_DELAY_S = 3.0
_FAILURES_KEY = "spark-estimator/failures"


@dataclass(frozen=True)
class RankInfo:
    """Where this task sits in the job: its ranks, the device it pinned, and, when it fell
    back to CPU although ``use_gpu`` asked for a GPU, why (``device_note``)."""

    rank: int
    world_size: int
    local_rank: int  # rank among the job's tasks on this host
    local_size: int
    device: torch.device
    device_note: str | None = None


_current: RankInfo | None = None


def current_rank_info() -> RankInfo:
    """The RankInfo of the process group this task is in; RuntimeError outside of one."""
    if _current is None:
        raise RuntimeError(
            "not inside a spark-estimator task: call this from a function run by "
            "spark_estimator.run or from the training loop's hooks"
        )
    return _current


def local_ranks(hosts: Sequence[str], rank: int) -> tuple[int, int]:
    """(local rank, local size) of ``rank`` given the host of every rank."""
    same = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    return same.index(rank), len(same)


def cuda_ordinal(address: str, visible_devices: str | None) -> int:
    """The torch device index of the GPU Spark calls ``address``.

    Spark's addresses are the ids its discovery script printed (physical ids). Where
    ``CUDA_VISIBLE_DEVICES`` restricts the process, torch numbers only the visible GPUs,
    so a listed id maps to its position in that list.
    """
    if visible_devices:
        visible = [v.strip() for v in visible_devices.split(",")]
        if address in visible:
            return visible.index(address)
    return int(address)


def select_device(
    use_gpu: bool,
    gpu_addresses: Sequence[str],
    cuda_available: bool,
    visible_devices: str | None = None,
) -> tuple[torch.device, str | None]:
    """The device for this task and, when falling back to CPU, the reason why.

    ``gpu_addresses`` are the GPU addresses Spark assigned to the task
    (``TaskContext.resources()["gpu"].addresses``); the first one is used.
    """
    if not use_gpu:
        return torch.device("cpu"), None
    if not gpu_addresses:
        return torch.device("cpu"), (
            "use_gpu=True but Spark assigned no GPU to this task (set "
            "spark.task.resource.gpu.amount); training on CPU"
        )
    if not cuda_available:
        return torch.device("cpu"), (
            f"use_gpu=True and Spark assigned GPU {gpu_addresses[0]}, but torch has no CUDA "
            "support here; training on CPU"
        )
    return torch.device("cuda", cuda_ordinal(gpu_addresses[0], visible_devices)), None


def task_gpu_addresses(resources: Mapping) -> list[str]:
    gpu = resources.get("gpu")
    return list(gpu.addresses) if gpu is not None else []


def task_device(ctx, use_gpu: bool, warn: bool = True) -> tuple[torch.device, str | None]:
    """Pin the device for the running Spark task ``ctx`` and size torch's threads; return
    the device and, on a CPU fallback, the reason (the driver turns it into a warning)."""
    device, reason = select_device(
        use_gpu,
        task_gpu_addresses(ctx.resources()),
        torch.cuda.is_available(),
        os.environ.get("CUDA_VISIBLE_DEVICES"),
    )
    if reason and warn:
        log.warning("spark-estimator task %d: %s", ctx.partitionId(), reason)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, ctx.cpus()))
    return device, reason


@contextmanager
def process_group(ctx, use_gpu: bool) -> Iterator[RankInfo]:
    """Join the barrier job's process group for the duration of the ``with`` block."""
    global _current
    infos = ctx.getTaskInfos()
    rank, world_size = ctx.partitionId(), len(infos)
    device, note = task_device(ctx, use_gpu)
    hosts = [info.address.rsplit(":", 1)[0] for info in infos]
    host = hosts[0]
    tcp_store = None
    if rank == 0:
        tcp_store = dist.TCPStore(
            host,
            0,
            world_size,
            is_master=True,
            timeout=RENDEZVOUS_TIMEOUT,
            wait_for_workers=False,
        )
        address = json.dumps({"host": host, "port": tcp_store.port, "pid": os.getpid()})
    else:
        address = ""
    master = json.loads(ctx.allGather(address)[0])
    if rank != 0:
        tcp_store = dist.TCPStore(
            master["host"],
            master["port"],
            world_size,
            is_master=False,
            timeout=RENDEZVOUS_TIMEOUT,
        )
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=tcp_store,
        rank=rank,
        world_size=world_size,
        timeout=RENDEZVOUS_TIMEOUT,
    )
    _current = RankInfo(rank, world_size, *local_ranks(hosts, rank), device, note)
    try:
        yield _current
        # nobody leaves while another rank still works: a gloo peer that closes its
        # connections early fails the others' collectives (and their setup)
        dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    except Exception as e:
        if not _first_failure(tcp_store):
            log.warning(
                "rank %d failed (%s) after another rank did; raising in %.0f s",
                rank,
                type(e).__name__,
                LATER_FAILURE_DELAY_S,
            )
            time.sleep(LATER_FAILURE_DELAY_S)
        raise
    finally:
        _current = None
        dist.destroy_process_group()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _first_failure(tcp_store) -> bool:
    """Whether no other rank of the job has failed before this one.

    When one rank raises, the others usually fail a moment later inside a collective
    ("connection closed by peer"), and Spark reports whichever task failure reaches it
    first. So the first rank to fail claims that in the job's TCPStore and raises at once;
    later ones wait ``LATER_FAILURE_DELAY_S`` first, by which time Spark has failed the job
    with the original error and kills them.
    """
    try:
        return tcp_store.add(_FAILURES_KEY, 1) == 1
    except Exception:  # the store went away with rank 0: a failure came first
        return False
