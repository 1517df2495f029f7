"""Executor: Horovod's collectives on the job's torch.distributed group.

Each takes Horovod's ``process_set`` keyword (default ``global_process_set``, the whole
job; see the ``process_sets`` module): the collective runs on that set's subgroup, an
Average divides by the set's size, and ``root_rank`` is a global rank, as Horovod's. On the
whole job each first starts the small control round that lets ranks waiting in
``hvd.join()`` take part (the ``joined`` module).

Tensors may be on the CPU or on the device the task pinned: each collective works on a
copy on the pinned device (NCCL reduces CUDA tensors only) and returns its result on the
input's device. ``name`` is accepted as Horovod's is, and only named in error messages
and a timeline's events (``start_timeline``): collectives are matched by the order in which
the ranks call them, not by name.

``allreduce``, ``allgather`` and ``broadcast`` are differentiable, as Horovod's: on a
tensor that requires grad (with grad enabled) the backward pass runs the collective's
adjoint on every rank: an allreduce of the gradient with the same op and scales; for
allgather the average of the gradient over the ranks, this rank's rows of it; for
broadcast that average on the root rank and zeros elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..worker.comm.adasum import adasum_allreduce_
from . import joined, timeline
from .compression import Compression, Compressor
from .core import TORCH_OPS, Adasum, Average, ReduceOp, rank_info, reduce_op
from .errors import peer_errors
from .process_sets import ProcessSet, Scope, global_process_set, scope

_MAX_DIMS = 16  # of a tensor allgather handles


def _scale_(tensor: torch.Tensor, factor: float) -> None:
    if factor == 1.0:
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.mul_(factor)
    else:  # integers: scaled in float64, truncated back
        tensor.copy_(tensor.double().mul_(factor).to(tensor.dtype))


def _named(name: str | None) -> str:
    return f" (tensor {name!r})" if name else ""


class Reduction:
    """An allreduce in flight of several tensors of one dtype: one fused collective (one
    per tensor for Adasum, which combines each tensor on its own). ``wait()`` gives the
    results, shaped as the inputs, on the pinned device."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        op: ReduceOp,
        compression: type[Compressor] = Compression.none,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        name: str | None = None,
        process_set: ProcessSet = global_process_set,
    ):
        info = rank_info()
        on = scope(process_set, "allreduce")
        if len({t.dtype for t in tensors}) > 1:
            raise TypeError(f"allreduce{_named(name)}: the tensors of one group share a dtype")
        self._shapes = [t.shape for t in tensors]
        self._compression = compression
        self._post = postscale_factor / (on.size if op == Average else 1)
        self._work = self._control = None
        if op == Adasum:
            if on.group is None:  # joined ranks cannot take part
                joined.require_all_active("allreduce", name, op=int(Adasum))
            self._buffers, self._ctx = self._compressed(
                [t.detach().to(info.device, copy=True) for t in tensors], prescale_factor
            )
            adasum_allreduce_(self._buffers, group=on.group)
            return
        flat = torch.cat([t.detach().reshape(-1).to(info.device) for t in tensors])
        self._buffers, self._ctx = self._compressed([flat], prescale_factor)
        self._started, self._name = time.perf_counter_ns(), name
        if on.group is None:  # joined ranks read it, and contribute to the data allreduce
            wire = self._buffers[0]
            self._control = joined.announce("allreduce", int(op), wire.dtype, wire.numel())
        self._work = dist.all_reduce(
            self._buffers[0], op=TORCH_OPS[op], group=on.group, async_op=True
        )

    def _compressed(self, buffers: list[torch.Tensor], prescale: float):
        for b in buffers:
            _scale_(b, prescale)
        pairs = [self._compression.compress(b) for b in buffers]
        return [p[0].contiguous() for p in pairs], pairs[0][1] if pairs else None

    def wait(self) -> list[torch.Tensor]:
        if self._work is not None:
            if self._control is not None:
                self._control.wait()
            self._work.wait()
            self._work = None
            timeline.add("allreduce (in flight)", self._name, self._started)
        out = [self._compression.decompress(b, self._ctx) for b in self._buffers]
        for b in out:
            _scale_(b, self._post)
        if len(out) == 1 and len(self._shapes) > 1:  # the fused buffer
            out = list(out[0].split([s.numel() for s in self._shapes]))
        return [b.view(s) for b, s in zip(out, self._shapes)]


@timeline.traced("allreduce")
@peer_errors
def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op=None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce a tensor over the ranks: ``postscale_factor * reduce(prescale_factor * tensor)``.

    A collective: every rank of ``process_set`` calls it, in the same order as its other
    collectives, with a tensor of the same shape and dtype. Differentiable, as Horovod's:
    on a tensor that requires grad the backward pass allreduces the gradient with the same
    op and scales.

    Parameters
    ----------
    tensor : torch.Tensor
        On the CPU or the task's device; left as it is.
    average : bool, optional
        Horovod's older form of ``op``: True is Average, False is Sum. Give one of the two.
    name : str, optional
        Named in error messages and a timeline's events only: collectives are matched by
        the order in which the ranks call them, not by name.
    compression : hvd.Compression.none, fp16 or bf16, default none
        How the tensor travels.
    op : hvd.ReduceOp, optional
        Average (the default: the sum divided by the set's size), Sum, Adasum, Min, Max or
        Product.
    prescale_factor, postscale_factor : float, default 1.0
        Factors applied before and after the reduction.
    process_set : hvd.ProcessSet, default hvd.global_process_set
        The ranks that reduce together (an added set, or the whole job).

    Returns
    -------
    torch.Tensor
        A new tensor with the result, on ``tensor``'s device.

    Raises
    ------
    ValueError
        Before ``hvd.init()``; ``op`` and ``average`` both given, or an unknown ``op``; this
        rank is not in ``process_set``.
    RuntimeError
        Ranks have joined (``hvd.join()``) and ``op`` is Adasum.
    HorovodInternalError
        Another rank failed, died or hung during the collective.

    Examples
    --------
    >>> import spark_estimator.horovod as hvd
    >>> avg_loss = hvd.allreduce(loss.detach(), name="loss")            # doctest: +SKIP
    >>> total = hvd.allreduce(torch.tensor([n]), op=hvd.Sum)            # doctest: +SKIP
    """
    op = reduce_op(op, average)
    if _differentiable(tensor):
        compressed, ctx = compression.compress(tensor)
        reduced = _Allreduce.apply(
            compressed, op, prescale_factor, postscale_factor, name, process_set
        )
        return compression.decompress(reduced, ctx)
    reduction = Reduction(
        [tensor], op, compression, prescale_factor, postscale_factor, name, process_set
    )
    return reduction.wait()[0].to(tensor.device)


def _differentiable(tensor: torch.Tensor) -> bool:
    return tensor.requires_grad and torch.is_grad_enabled()


def _reduced(tensor: torch.Tensor, op, pre: float, post: float, name, process_set):
    reduction = Reduction([tensor], op, Compression.none, pre, post, name, process_set)
    return reduction.wait()[0].to(tensor.device)


class _Allreduce(torch.autograd.Function):
    """allreduce in autograd: its backward is the same allreduce of the gradient."""

    @staticmethod
    def forward(ctx, tensor, op, prescale_factor, postscale_factor, name, process_set):
        ctx.reduction = (op, prescale_factor, postscale_factor, name, process_set)
        return _reduced(tensor, *ctx.reduction)

    @staticmethod
    def backward(ctx, grad):
        return _reduced(grad.contiguous(), *ctx.reduction), None, None, None, None, None


class _Allgather(torch.autograd.Function):
    """allgather in autograd: the set's average of the gradient, this rank's rows."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        ctx.name, ctx.process_set = name, process_set
        return _gathered(tensor, name, process_set)

    @staticmethod
    def backward(ctx, grad):
        averaged = _reduced(grad.contiguous(), Average, 1.0, 1.0, ctx.name, ctx.process_set)
        rows = _gathered(torch.tensor([ctx.rows]), ctx.name, ctx.process_set)
        offset = int(rows[: scope(ctx.process_set, "allgather").rank].sum())
        return averaged.narrow(0, offset, ctx.rows), None, None


class _Broadcast(torch.autograd.Function):
    """broadcast in autograd: the set's average of the gradient on the root, else 0."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.name, ctx.process_set = root_rank, name, process_set
        return _broadcasted(tensor, root_rank, process_set)

    @staticmethod
    def backward(ctx, grad):
        averaged = _reduced(grad.contiguous(), Average, 1.0, 1.0, ctx.name, ctx.process_set)
        if rank_info().rank != ctx.root:
            averaged.zero_()
        return averaged, None, None, None


@peer_errors
def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op=None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """``allreduce`` written into ``tensor``, which is returned."""
    result = allreduce(
        tensor, average, name, compression, op, prescale_factor, postscale_factor, process_set
    )
    with torch.no_grad():
        return tensor.copy_(result)


@timeline.traced("grouped_allreduce")
@peer_errors
def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op=None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """``allreduce`` of each tensor, as new tensors in the same order: one fused collective
    per dtype among them."""
    op = reduce_op(op, average)
    tensors = list(tensors)
    started = reductions_by_dtype(
        tensors, op, compression, prescale_factor, postscale_factor, name, process_set
    )
    results: list[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    for indices, reduction in started:
        for i, result in zip(indices, reduction.wait()):
            results[i] = result.to(tensors[i].device)
    return results


def reductions_by_dtype(
    tensors: Sequence[torch.Tensor],
    op: ReduceOp,
    compression,
    pre: float,
    post: float,
    name,
    process_set: ProcessSet = global_process_set,
) -> list[tuple[list[int], Reduction]]:
    """One fused Reduction started per dtype among ``tensors``, with the positions of its
    tensors (``grouped_allreduce``, and its asynchronous forms)."""
    tensors = list(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    return [
        (idx, Reduction([tensors[i] for i in idx], op, compression, pre, post, name, process_set))
        for idx in by_dtype.values()
    ]


def checked(process_set: ProcessSet, kind: str, name: str | None = None) -> Scope:
    """The scope of a collective that joined ranks cannot take part in (not an allreduce):
    on the whole job its control round first, which raises where ranks have joined."""
    on = scope(process_set, kind)
    if on.group is None:
        joined.require_all_active(kind, name)
    return on


@timeline.traced("allgather")
@peer_errors
def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """The tensors of ``process_set``'s ranks concatenated along the first dimension.

    A collective: every rank of ``process_set`` calls it. Differentiable, as Horovod's: the
    backward pass gives each rank its rows of the ranks' average gradient.

    Parameters
    ----------
    tensor : torch.Tensor
        This rank's rows. The ranks' first dimensions may differ; the others must agree (a
        0-d tensor counts as one element); at most 16 dimensions.
    name : str, optional
        Named in error messages and a timeline's events only.
    process_set : hvd.ProcessSet, default hvd.global_process_set
        The ranks that gather together.

    Returns
    -------
    torch.Tensor
        The ranks' tensors in rank order, on ``tensor``'s device.

    Raises
    ------
    ValueError
        The ranks' shapes differ beyond the first dimension; more than 16 dimensions;
        before ``hvd.init()``; this rank is not in ``process_set``.
    RuntimeError
        Ranks have joined (``hvd.join()``): only allreduces run while they wait.
    HorovodInternalError
        Another rank failed, died or hung during the collective.

    Examples
    --------
    >>> import spark_estimator.horovod as hvd
    >>> all_preds = hvd.allgather(preds)                                # doctest: +SKIP
    """
    if _differentiable(tensor):
        return _Allgather.apply(tensor, name, process_set)
    return _gathered(tensor, name, process_set)


def _gathered(tensor: torch.Tensor, name: str | None, process_set: ProcessSet) -> torch.Tensor:
    work, finish = gather(tensor, name, async_op=False, process_set=process_set)
    return finish()


def gather(
    tensor: torch.Tensor,
    name: str | None,
    async_op: bool,
    process_set: ProcessSet = global_process_set,
    kind: str = "allgather",
):
    """Start an allgather: (its work, None when done already; a function giving the result
    once it is). The ranks' shapes travel first, at once (a small collective)."""
    info = rank_info()
    on = checked(process_set, kind, name)
    work = tensor.detach().to(info.device).reshape(tensor.shape or (1,)).contiguous()
    if work.dim() > _MAX_DIMS:
        raise ValueError(f"allgather{_named(name)}: at most {_MAX_DIMS} dimensions")
    meta = torch.zeros(_MAX_DIMS + 1, dtype=torch.int64, device=info.device)
    meta[0] = work.dim()
    meta[1 : work.dim() + 1] = torch.tensor(work.shape, dtype=torch.int64)
    metas = [torch.empty_like(meta) for _ in range(on.size)]
    dist.all_gather(metas, meta, group=on.group)
    shapes = [tuple(m[1 : int(m[0]) + 1].tolist()) for m in (m.cpu() for m in metas)]
    if any(s[1:] != shapes[0][1:] for s in shapes):
        raise ValueError(
            f"allgather{_named(name)}: the ranks' tensors differ beyond the first "
            f"dimension: shapes by rank {shapes}"
        )
    rows = max(s[0] for s in shapes)
    padded = work.new_zeros((rows, *work.shape[1:]))
    padded[: work.shape[0]] = work
    gathered = [torch.empty_like(padded) for _ in range(on.size)]
    work = dist.all_gather(gathered, padded, group=on.group, async_op=async_op)

    def finish() -> torch.Tensor:
        return torch.cat([g[: s[0]] for g, s in zip(gathered, shapes)]).to(tensor.device)

    return work, finish


def check_root(
    root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> None:
    """``root_rank`` is a global rank (as Horovod's) in ``process_set``."""
    ranks = scope(process_set, "broadcast").ranks
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or root_rank not in ranks:
        where = (
            f"a rank in [0, {len(ranks)})"
            if process_set is None or process_set.process_set_id == 0
            else f"one of the process set's (global) ranks {ranks}"
        )
        raise ValueError(f"root_rank{_named(name)}: must be {where}, got {root_rank!r}")


@timeline.traced("broadcast")
@peer_errors
def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """A new tensor holding ``root_rank``'s ``tensor``.

    A collective: every rank of ``process_set`` calls it. Differentiable, as Horovod's: the
    backward pass gives the root rank the ranks' average gradient and the others zeros.

    Parameters
    ----------
    tensor : torch.Tensor
        Of the same shape and dtype on every rank; the root's is sent.
    root_rank : int
        The sending rank: a global rank (``hvd.rank()``), as Horovod's, in ``process_set``.
    name : str, optional
        Named in error messages and a timeline's events only.
    process_set : hvd.ProcessSet, default hvd.global_process_set
        The ranks that take part.

    Returns
    -------
    torch.Tensor
        A copy of the root's tensor, on ``tensor``'s device; ``tensor`` is left as it is
        (``broadcast_`` writes into it).

    Raises
    ------
    ValueError
        ``root_rank`` is not a rank of ``process_set``; before ``hvd.init()``.
    RuntimeError
        Ranks have joined (``hvd.join()``): only allreduces run while they wait.
    HorovodInternalError
        Another rank failed, died or hung during the collective.

    Examples
    --------
    >>> import spark_estimator.horovod as hvd
    >>> seed = hvd.broadcast(torch.randint(0, 2**31, ()), root_rank=0)  # doctest: +SKIP
    """
    check_root(root_rank, name, process_set)
    if _differentiable(tensor):
        return _Broadcast.apply(tensor, root_rank, name, process_set)
    return _broadcasted(tensor, root_rank, process_set)


def _broadcasted(tensor: torch.Tensor, root_rank: int, process_set: ProcessSet) -> torch.Tensor:
    _, work = broadcast_start(tensor, root_rank, process_set)
    return work.to(tensor.device)


def broadcast_start(
    tensor: torch.Tensor,
    root_rank: int,
    process_set: ProcessSet,
    name: str | None = None,
    async_op: bool = False,
):
    """The broadcast from ``root_rank`` into a copy of ``tensor`` on this rank's device,
    started (``async_op``) or done: torch's work (None when done) and the copy."""
    on = checked(process_set, "broadcast", name)
    work = tensor.detach().to(rank_info().device, copy=True).contiguous()
    return dist.broadcast(work, src=root_rank, group=on.group, async_op=async_op), work


@peer_errors
def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """``root_rank``'s ``tensor`` written into ``tensor``, which is returned."""
    result = broadcast(tensor, root_rank, name, process_set)
    with torch.no_grad():
        return tensor.copy_(result)


def broadcast_tensors_(
    tensors: Sequence[torch.Tensor], root_rank: int, process_set: ProcessSet = global_process_set
) -> None:
    """``broadcast_`` of each tensor, with one collective per dtype among them."""
    check_root(root_rank, None, process_set)
    on = checked(process_set, "broadcast")
    device = rank_info().device
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1).to(device) for t in group])
        dist.broadcast(flat, src=root_rank, group=on.group)
        with torch.no_grad():
            for t, part in zip(group, flat.split([t.numel() for t in group])):
                t.copy_(part.view(t.shape))


@timeline.traced("broadcast_object")
@peer_errors
def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """``root_rank``'s ``obj`` (any picklable object) on every rank of ``process_set``."""
    check_root(root_rank, name, process_set)
    info = rank_info()
    on = checked(process_set, "broadcast_object", name)
    holder = [obj if info.rank == root_rank else None]
    dist.broadcast_object_list(holder, src=root_rank, group=on.group, device=info.device)
    return holder[0]


@timeline.traced("allgather_object")
@peer_errors
def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list:
    """Every ``process_set`` rank's ``obj`` (any picklable object), in rank order."""
    on = checked(process_set, "allgather_object", name)
    gathered = [None] * on.size
    dist.all_gather_object(gathered, obj, group=on.group)
    return gathered


@timeline.traced("barrier")
@peer_errors
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of ``process_set`` has reached this call."""
    info = rank_info()
    on = checked(process_set, "barrier")
    if info.device.type == "cuda":
        dist.barrier(group=on.group, device_ids=[info.device.index])
    else:
        dist.barrier(group=on.group)


@timeline.traced("join")
@peer_errors
def join() -> int:
    """Wait until every rank has called ``join()``, taking part in the others' allreduces.

    A rank with no more batches calls it; until every rank has, it contributes zeros to
    the allreduces of the ranks that have not (an Average still divides by the job's size),
    as Horovod's (the ``hvd.join`` control round, in the ``joined`` module). Other
    collectives cannot run while ranks are joined.

    Returns
    -------
    int
        The rank that called ``join()`` last.

    Raises
    ------
    RuntimeError
        The other ranks called a collective that joined ranks cannot take part in (not an
        allreduce, or an Adasum allreduce).
    HorovodInternalError
        Another rank failed, died or hung during the collective.

    Examples
    --------
    >>> for batch in my_batches:                                        # doctest: +SKIP
    ...     train_step(batch)
    >>> last = hvd.join()                                               # doctest: +SKIP
    """
    return joined.join()
