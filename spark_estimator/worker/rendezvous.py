"""Executor: pin the device Spark assigned, join the job's torch.distributed process group.

Rank 0 starts a TCPStore on an OS-chosen port (bound before anyone is told of it, so no
other process can take the port in between) and shares the address through the barrier
context's ``allGather``; every rank then joins one process group (gloo on CPU, NCCL on GPU).
The group is destroyed when the task ends, failed or not, because PySpark reuses workers.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    device: torch.device


def select_device(
    use_gpu: bool, gpu_addresses: Sequence[str], cuda_available: bool
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
    return torch.device("cuda", int(gpu_addresses[0])), None


def task_gpu_addresses(resources: Mapping) -> list[str]:
    gpu = resources.get("gpu")
    return list(gpu.addresses) if gpu is not None else []


def task_device(ctx, use_gpu: bool, warn: bool = True) -> torch.device:
    """Pin and return the device for the running Spark task ``ctx``; size torch's threads."""
    device, reason = select_device(
        use_gpu, task_gpu_addresses(ctx.resources()), torch.cuda.is_available()
    )
    if reason and warn:
        # a warning where a GPU exists but was not assigned (a misconfiguration), else info
        level = logging.WARNING if torch.cuda.is_available() else logging.INFO
        log.log(level, "spark-estimator task %d: %s", ctx.partitionId(), reason)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, ctx.cpus()))
    return device


@contextmanager
def process_group(ctx, use_gpu: bool) -> Iterator[RankInfo]:
    """Join the barrier job's process group for the duration of the ``with`` block."""
    rank, world_size = ctx.partitionId(), len(ctx.getTaskInfos())
    device = task_device(ctx, use_gpu)
    host = ctx.getTaskInfos()[0].address.rsplit(":", 1)[0]
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
    try:
        yield RankInfo(rank, world_size, device)
    finally:
        dist.destroy_process_group()
        if device.type == "cuda":
            torch.cuda.empty_cache()
