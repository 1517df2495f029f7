"""Executor: the device a task computes on, pinned for the task: the GPU Spark assigned it
(its torch ordinal where ``CUDA_VISIBLE_DEVICES`` renumbers the GPUs), or the CPU, with the
reason where ``use_gpu="auto"`` fell back to it; torch's thread count (the task's CPUs),
and the thread-count variables of the libraries a task starts later (``thread_environment``:
the tokenizers package's Rayon pool, OpenMP and MKL of the processes it starts)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

import torch

# set to the task's CPUs where the user has not set them (``thread_environment``)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS")
# what ``set_thread_environment`` put in this process's environment: PySpark's Python
# workers run task after task, and a value an earlier task set is not the user's
_set_here: dict[str, str] = {}


def thread_environment(
    cpus: int, environ: Mapping[str, str], ours: Mapping[str, str]
) -> dict[str, str]:
    """The variables to set for a task of ``cpus`` CPUs: each of ``THREAD_VARIABLES`` as
    ``cpus``, unless ``environ`` holds a value of it that is not one an earlier task of this
    process set (``ours``). That one is the user's (``spark.executorEnv.<NAME>``, the
    executor's environment) or Spark's (``OMP_NUM_THREADS``, the task's CPUs, in every
    Python worker unless ``spark.executorEnv.OMP_NUM_THREADS`` is set), and is kept."""
    count = str(max(1, cpus))
    return {
        name: count
        for name in THREAD_VARIABLES
        if name not in environ or (name in ours and environ[name] == ours[name])
    }


def set_thread_environment(cpus: int) -> dict[str, str]:
    """Set ``thread_environment``'s variables in ``os.environ``; return them. The tokenizers
    package reads ``RAYON_NUM_THREADS`` when its pool first starts in the process, so this
    runs before the task's code (and the decode workers it starts inherit the rest)."""
    values = thread_environment(cpus, os.environ, _set_here)
    os.environ.update(values)
    _set_here.update(values)
    return values


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
    """Pin the device for the running Spark task ``ctx`` and size torch's threads (and
    ``set_thread_environment``'s variables) to its CPUs; return the device and, on a CPU
    fallback, the reason (the driver turns it into one warning).

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
    set_thread_environment(ctx.cpus())
    return device, reason
