"""Executor: the device a task computes on, pinned for the task: the GPU Spark assigned it
(its torch ordinal where ``CUDA_VISIBLE_DEVICES`` renumbers the GPUs), or the CPU, with the
reason where ``use_gpu="auto"`` fell back to it; and torch's thread count (the task's
CPUs)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

import torch


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
    use_gpu: bool | str,
    gpu_addresses: Sequence[str],
    cuda_available: bool,
    visible_devices: str | None = None,
) -> tuple[torch.device, str | None]:
    """The device for this task and, when falling back to CPU, the reason why.

    ``use_gpu`` is what the driver told the tasks (``driver.validate.tasks_use_gpu``):
    False, the CPU; ``"auto"`` (the cluster has GPUs configured), the GPU Spark assigned,
    else the CPU with a reason; True, that GPU or a RuntimeError naming ``use_gpu``.
    ``gpu_addresses`` are the GPU addresses Spark assigned to the task
    (``TaskContext.resources()["gpu"].addresses``); the first one is used.
    """
    if not use_gpu:
        return torch.device("cpu"), None
    if not gpu_addresses:
        if use_gpu is True:
            raise RuntimeError(
                "use_gpu: True requires a GPU for every task, but Spark assigned no GPU to "
                "this task (set spark.task.resource.gpu.amount)"
            )
        return torch.device("cpu"), (
            "GPUs are configured but this task got none (set spark.task.resource.gpu.amount "
            "to give each task one); training on CPU"
        )
    if not cuda_available:
        if use_gpu is True:
            raise RuntimeError(
                f"use_gpu: True and Spark assigned GPU {gpu_addresses[0]}, but torch has no "
                "CUDA support here (a CPU-only torch?)"
            )
        return torch.device("cpu"), (
            f"Spark assigned GPU {gpu_addresses[0]}, but torch has no CUDA support here; "
            "training on CPU"
        )
    return torch.device("cuda", cuda_ordinal(gpu_addresses[0], visible_devices)), None


def task_gpu_addresses(resources: Mapping) -> list[str]:
    gpu = resources.get("gpu")
    return list(gpu.addresses) if gpu is not None else []


def task_device(ctx, use_gpu: bool | str, warn: bool = True) -> tuple[torch.device, str | None]:
    """Pin the device for the running Spark task ``ctx`` and size torch's threads; return
    the device and, on a CPU fallback, the reason (the driver turns it into one warning).

    With ``warn`` the reason is also written to the executor's own log (its stderr),
    bypassing the capture of the rank's output (``run_log``): every rank would repeat it
    there, and it would open every ``TrainingError`` of a CPU cluster."""
    device, reason = select_device(
        use_gpu,
        task_gpu_addresses(ctx.resources()),
        torch.cuda.is_available(),
        os.environ.get("CUDA_VISIBLE_DEVICES"),
    )
    if reason and warn:
        print(f"spark-estimator task {ctx.partitionId()}: {reason}", file=sys.__stderr__)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, ctx.cpus()))
    return device, reason
