"""Executor: the model sharded over the ranks with FSDP2 (``parallelism="fsdp"``).

``fully_shard`` over a one-dimensional device mesh of every rank (gloo on CPU, NCCL on
GPUs): each rank keeps 1/world of every parameter, its gradient and (the optimizer being
built on the sharded parameters) its optimizer state, and gathers a unit's parameters only
while that unit computes. The units are the submodules whose class ``fsdp_wrap`` names
(children before their parents) and always the whole model. ``mixed_precision`` becomes
FSDP's policy: parameters gathered and computed in bf16/fp16, gradients reduced and kept in
float32, the model's outputs float32. With ``backward_passes_per_step > 1`` the first
passes of a group skip the gradients' reduce-scatter (``no_sync``).

The fitted model's weights are gathered to rank 0's CPU one parameter at a time
(``full_state_dict``): never the whole model on a GPU, but the whole of it in rank 0's
memory, which is refused up front when it would not fit.

On CPU ranks the process's allocator (glibc) is told to give every block of 1 MiB or more its
own mapping (``return_freed_blocks``): FSDP frees each unit's gathered parameters and
unsharded gradients after use, and glibc's default, a threshold that rises to 32 MiB as
large blocks are freed, keeps such blocks in its heap, where the next unit's land beside
them instead of reusing them; the resident set then grows well past what the rank holds.

Imported only where a fit is sharded (or ``sd.device_mesh()`` is called): torch's FSDP
and checkpoint modules take about a second to import on every rank.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ...shared.spec import PRECISION_DTYPES, torch_dtype
from ..data.device_shard import available_ram
from .ranks import RankInfo


def policy(mixed_precision: str, root: bool) -> MixedPrecisionPolicy:
    """FSDP's mixed-precision policy for the ``mixed_precision`` param; the ``root``'s
    returns float32 outputs (a unit's stay in the dtype the next layer computes in)."""
    if mixed_precision == "none":
        return MixedPrecisionPolicy()
    dtype = torch_dtype(PRECISION_DTYPES[mixed_precision])
    output = torch.float32 if root else None
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, output_dtype=output)


def mesh(info: RankInfo, job: str):
    """The one-dimensional device mesh of every rank of barrier job ``job`` (a name the
    same on every rank of one job and new for the next). torch compares meshes, and keys
    DTensor's caches, by their ranks and names but not by the process's own rank, so a
    Python worker that Spark reuses for another job, as another rank, would be given the
    layout it computed as its old rank (a shard's offset in a checkpoint, found when
    resuming in a reused worker): each job's mesh is named after it."""
    return init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=(job,))


def shard_model(
    model: torch.nn.Module,
    info: RankInfo,
    wrap: tuple[str, ...],
    mixed_precision: str,
    job: str = "ranks",
) -> torch.nn.Module:
    """Shard ``model`` (in place, on its device or on meta) over every rank; the units are
    its submodules of the classes named in ``wrap``, then the model itself. ``job`` names
    the mesh (``mesh``)."""
    classes = {type(m).__name__ for m in model.modules()}
    missing = sorted(set(wrap) - classes)
    if missing:
        raise ValueError(
            f"fsdp_wrap: the model has no submodule of class {missing}; its classes are "
            f"{sorted(classes)}"
        )
    if info.device.type == "cpu":
        return_freed_blocks()
    ranks = mesh(info, job)
    units = [m for m in model.modules() if m is not model and type(m).__name__ in wrap]
    for unit in reversed(units):  # modules() lists parents first: shard children first
        fully_shard(unit, mesh=ranks, mp_policy=policy(mixed_precision, root=False))
    fully_shard(model, mesh=ranks, mp_policy=policy(mixed_precision, root=True))
    return model


M_MMAP_THRESHOLD = -3  # glibc's mallopt option (malloc.h)
MMAP_THRESHOLD = 1 << 20


def return_freed_blocks() -> bool:
    """Have glibc's malloc map each block of ``MMAP_THRESHOLD`` bytes or more on its own,
    so that freeing it returns it to the system at once (see the module); whether it was
    set (False where the C library is not glibc). For the rest of the process's life: a
    Python worker Spark reuses keeps it, which costs later tasks only a page fault per
    large block."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not hasattr(libc, "gnu_get_libc_version"):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


@contextlib.contextmanager
def no_sync(model: torch.nn.Module):
    """Backward passes that keep their gradients local (no reduce-scatter)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def local_elements(model: torch.nn.Module) -> int:
    """The parameter elements this rank holds (its shards; all of them under DDP)."""
    return sum(
        p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters()
    )


def full_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's whole state dict (every shard gathered)."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def full_state_dict(model: torch.nn.Module) -> dict:
    """The whole state dict on rank 0's CPU (empty on the others), gathered one tensor at a
    time; a collective of every rank. Refused on every rank, before gathering, when it
    would not fit rank 0's available memory: a model that fits no single process can be
    trained and checkpointed sharded, not turned into a TorchModel."""
    need = torch.tensor([full_bytes(model), available_bytes()], dtype=torch.float64)
    need = need.to(next(model.parameters()).device)
    torch.distributed.broadcast(need, src=0)
    need = need.tolist()
    if need[0] > need[1]:
        raise MemoryError(
            f"parallelism='fsdp': the fitted model's weights ({need[0] / 2**30:.1f} GiB) do not "
            f"fit rank 0's available memory ({need[1] / 2**30:.1f} GiB); a model that fits no "
            "single process cannot become a TorchModel (docs/large-models.md); its sharded "
            "checkpoints are in the run's folder of the store"
        )
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def available_bytes() -> int:
    """The memory rank 0 may still take for the gathered weights."""
    return available_ram()
