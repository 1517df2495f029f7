"""Executor: the model wrapped in DistributedDataParallel, and how its gradients travel.

With one process there is nothing to average: the model trains as it is, without DDP's
wrapper and reducer (their per-step cost is measurable on small models).

When every rank is a CPU process on one host, gradient buckets are averaged through shared
memory (``SharedMemoryAllreduce``) rather than gloo's sockets. Otherwise DDP's own allreduce is
used (gloo or NCCL), unless gradient compression is asked for.

Compression is a DDP communication hook: each gradient bucket is cast to fp16 or bf16,
divided by the world size, summed across ranks in that dtype and cast back, so half as
many bytes cross the network. The hook records the dtype it communicated and how many
bucket allreduces it ran, which the rank summary reports. It is our own hook rather than
torch's ``bf16_compress_hook``, which refuses to run on gloo (CPU) though gloo sums bf16.

``gradient_reduction="adasum"`` replaces the average (and the shared-memory path) by a hook
that runs ``adasum_allreduce_`` on each parameter's gradient within the bucket: Adasum is
defined per tensor, and a bucket's flat buffer is several tensors side by side. With
compression too, each gradient travels in the compressed dtype and is combined in float64
(what Adasum always does).
"""

# no ``from __future__ import annotations``: DDP checks the hook's return annotation object
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ...shared.spec import PRECISION_DTYPES, torch_dtype
from .adasum import adasum_allreduce_
from .ranks import RankInfo
from .rendezvous import at_leave
from .shm_allreduce import SharedMemoryAllreduce


class CompressionState:
    """The hook's state: the dtype to communicate in; what it actually sent and how often."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.sent: set[str] = set()
        self.calls = 0  # bucket allreduces


def compressed_allreduce(state: CompressionState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average a gradient bucket across ranks in ``state.dtype``."""
    buffer = bucket.buffer()
    compressed = buffer.to(state.dtype).div_(dist.get_world_size())
    state.sent.add(str(compressed.dtype).removeprefix("torch."))
    state.calls += 1
    future = dist.all_reduce(compressed, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


class AdasumState:
    """The Adasum hook's state: the dtype to communicate in (None: each gradient's own),
    what it actually sent when compressing, and how many buckets it reduced."""

    def __init__(self, dtype: torch.dtype | None):
        self.dtype = dtype
        self.sent: set[str] = set()
        self.calls = 0  # bucket reductions


def adasum_reduce(state: AdasumState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: each parameter's gradient in the bucket (views of its buffer)
    becomes its Adasum across ranks; the backward pass waits for it."""
    gradients = bucket.gradients()
    if state.dtype is None:
        adasum_allreduce_(gradients)
    else:
        sent = [g.to(state.dtype) for g in gradients]
        state.sent.update(str(t.dtype).removeprefix("torch.") for t in sent)
        adasum_allreduce_(sent)
        for gradient, reduced in zip(gradients, sent):
            gradient.copy_(reduced)
    state.calls += 1
    buffer = bucket.buffer()
    future = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
    future.set_result(buffer)
    return future


def shared_memory_allreduce(
    state: SharedMemoryAllreduce, bucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average a gradient bucket through shared memory (the
    backward pass waits for it: its seconds are the step's communication)."""
    start = time.perf_counter()
    future = torch.futures.Future()
    future.set_result(state.average_(bucket.buffer()))
    state.seconds += time.perf_counter() - start
    return future


def wrap_model(
    model: torch.nn.Module,
    info: RankInfo,
    compression: str,
    timeout_s: float,
    reduction: str = "average",
) -> tuple[torch.nn.Module, "CompressionState | AdasumState | SharedMemoryAllreduce | None"]:
    """DDP around ``model`` (which broadcasts rank 0's weights to every rank) and the state
    of its communication hook: an ``AdasumState`` (``reduction="adasum"``), a
    ``CompressionState``, a ``SharedMemoryAllreduce`` (every rank a CPU process on one host;
    waits bounded by ``timeout_s``) or None (DDP's own). With one process: ``model`` itself
    and None."""
    if info.world_size == 1:
        return model, None
    device = info.device
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    if reduction == "adasum":
        dtype = None if compression == "none" else torch_dtype(PRECISION_DTYPES[compression])
        adasum = AdasumState(dtype)
        ddp.register_comm_hook(adasum, adasum_reduce)
        return ddp, adasum
    if compression != "none":  # asked for: it is about the bytes on the network
        state = CompressionState(torch_dtype(PRECISION_DTYPES[compression]))
        ddp.register_comm_hook(state, compressed_allreduce)
        return ddp, state
    shared = open_shared_memory(info, timeout_s)
    if shared is not None:
        ddp.register_comm_hook(shared, shared_memory_allreduce)
    return ddp, shared


def open_shared_memory(info: RankInfo, timeout_s: float) -> SharedMemoryAllreduce | None:
    """The shared-memory allreduce when every rank is a CPU process on this host and all
    can map it, else None (on every rank: a collective whenever the ranks qualify). It is
    closed when the task leaves the process group (``rendezvous.at_leave``)."""
    if info.device.type != "cpu" or not 1 < info.world_size == info.local_size:
        return None
    shared = SharedMemoryAllreduce.open(info.rank, info.world_size, timeout_s)
    if shared is not None:
        at_leave(shared.close)  # only once a failing rank has claimed its failure
    return shared


def gradient_path(state: "CompressionState | AdasumState | SharedMemoryAllreduce | None") -> str:
    """How the gradients travelled, for the rank's summary."""
    if dist.get_world_size() == 1:
        return "none (one process)"
    if isinstance(state, SharedMemoryAllreduce):
        return "shared memory"
    if isinstance(state, AdasumState):
        compressed = " compressed" if state.dtype is not None else ""
        return f"adasum ({dist.get_backend()}){compressed}"
    return f"{dist.get_backend()}{' compressed' if state is not None else ''}"


def communicated_dtypes(
    state: "CompressionState | AdasumState | SharedMemoryAllreduce | None",
) -> list[str] | None:
    """The dtypes gradient_compression sent, for the rank's summary; None without it."""
    if isinstance(state, CompressionState) or (
        isinstance(state, AdasumState) and state.dtype is not None
    ):
        return sorted(state.sent)
    return None


def broadcast_buffers(model: torch.nn.Module, world_size: int) -> None:
    """Rank 0's buffers (BatchNorm's running statistics) on every rank. DDP gives each
    forward rank 0's buffers, so after an epoch's last step every rank holds its own: made
    rank 0's there, validation, the checkpoint and the final weights agree on every rank."""
    if world_size < 2:
        return
    for buffer in model.buffers():
        dist.broadcast(buffer.data, src=0)
