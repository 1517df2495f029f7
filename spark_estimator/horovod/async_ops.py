"""Executor: Horovod's asynchronous collectives, and alltoall and reducescatter.

An ``*_async`` call starts its collective on torch.distributed's asynchronous work and
returns a handle (an int) at once, while the ranks exchange the data; ``poll(handle)``
says whether it has finished, without waiting, and ``synchronize(handle)`` waits for it
and returns its result (the handle is then spent; an unknown handle gives None, as
Horovod's). Where a collective needs the ranks' shapes first (allgather, alltoall), that
small exchange happens before the call returns; the data travels after. ``alltoall``
sends each rank its rows of ``tensor`` (``splits``, or as equal as they go, the first
ranks one more) and returns what it received, with the received splits when ``splits``
was given; it is differentiable, as Horovod's. ``reducescatter`` is the allreduce of which
each rank keeps its rows (dim 0 cut as equally as it goes, the first ranks one more).
Each takes ``process_set`` as ``allreduce`` and the other collectives do (the ranks, the
sizes and splits are the set's).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .collectives import (
    Reduction,
    _named,
    broadcast_start,
    check_root,
    checked,
    gather,
    reductions_by_dtype,
)
from .compression import Compression
from .core import Average, Sum, rank_info, reduce_op
from .errors import peer_errors
from .process_sets import ProcessSet, global_process_set, scope

_GLOBAL = global_process_set

_pending: dict[int, _Op] = {}
_ids = itertools.count(1)


class _Op:
    """A collective in flight: torch's works and what makes the result once they end."""

    def __init__(self, works: Sequence, finish: Callable):
        self.works = [w for w in works if w is not None]
        self.finish = finish

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def result(self):
        for w in self.works:
            w.wait()
        return self.finish()


def _handle(works: Sequence, finish: Callable) -> int:
    handle = next(_ids)
    _pending[handle] = _Op(works, finish)
    return handle


@peer_errors
def poll(handle: int) -> bool:
    """Whether the collective of ``handle`` has finished (``synchronize`` will not wait)."""
    if handle not in _pending:
        raise ValueError(f"handle: {handle!r} is not a collective in flight")
    return _pending[handle].done()


@peer_errors
def synchronize(handle: int):
    """Wait for the collective of ``handle`` and return its result."""
    op = _pending.pop(handle, None)
    return None if op is None else op.result()


@peer_errors
def allreduce_async(
    tensor,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set: ProcessSet = _GLOBAL,
) -> int:
    """Start an ``allreduce`` and return at once, with a handle for its result.

    The ranks exchange the data while this rank goes on; ``poll(handle)`` says whether it
    has finished and ``synchronize(handle)`` waits for it and returns the result.

    Parameters
    ----------
    tensor : torch.Tensor
        On the CPU or the task's device; left as it is.
    average : bool, optional
        Horovod's older form of ``op``: True is Average, False is Sum.
    name : str, optional
        Named in error messages and a timeline's events only.
    op : hvd.ReduceOp, optional
        Average (the default), Sum, Adasum, Min, Max or Product, as ``allreduce``'s.
    prescale_factor, postscale_factor : float, default 1.0
        Factors applied before and after the reduction.
    process_set : hvd.ProcessSet, default hvd.global_process_set
        The ranks that reduce together.

    Returns
    -------
    int
        The handle: ``synchronize(handle)`` gives a new tensor with the result, on
        ``tensor``'s device.

    Raises
    ------
    ValueError
        As ``allreduce``: before ``hvd.init()``, ``op`` and ``average`` both given or an
        unknown ``op``, a rank outside ``process_set``.
    HorovodInternalError
        Another rank failed, died or hung during the collective.

    Examples
    --------
    >>> handle = hvd.allreduce_async(grad, name="grad")                 # doctest: +SKIP
    >>> hvd.poll(handle)                                                # doctest: +SKIP
    False
    >>> grad = hvd.synchronize(handle)                                  # doctest: +SKIP
    """
    reduction = Reduction(
        [tensor],
        reduce_op(op, average),
        Compression.none,
        prescale_factor,
        postscale_factor,
        name,
        process_set,
    )
    return _handle([reduction._work], lambda: reduction.wait()[0].to(tensor.device))


@peer_errors
def allreduce_async_(
    tensor,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set: ProcessSet = _GLOBAL,
) -> int:
    """``allreduce_``, started: ``synchronize`` writes the result into ``tensor``."""
    reduction = Reduction(
        [tensor],
        reduce_op(op, average),
        Compression.none,
        prescale_factor,
        postscale_factor,
        name,
        process_set,
    )
    return _handle([reduction._work], lambda: _into(tensor, reduction.wait()[0]))


@peer_errors
def grouped_allreduce_async(
    tensors,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set: ProcessSet = _GLOBAL,
) -> int:
    """``grouped_allreduce``, started (one fused collective per dtype)."""
    op = reduce_op(op, average)
    return _grouped(tensors, op, prescale_factor, postscale_factor, name, False, process_set)


@peer_errors
def grouped_allreduce_async_(
    tensors,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set: ProcessSet = _GLOBAL,
) -> int:
    """``grouped_allreduce`` in place, started."""
    op = reduce_op(op, average)
    return _grouped(tensors, op, prescale_factor, postscale_factor, name, True, process_set)


@peer_errors
def grouped_allreduce_(
    tensors,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set: ProcessSet = _GLOBAL,
) -> list:
    """Each tensor's allreduce written into it; the tensors."""
    return synchronize(
        grouped_allreduce_async_(
            tensors, average, name, op, prescale_factor, postscale_factor, process_set
        )
    )


def _grouped(tensors, op, pre, post, name, in_place: bool, process_set) -> int:
    tensors = list(tensors)
    parts = reductions_by_dtype(tensors, op, Compression.none, pre, post, name, process_set)

    def finish() -> list[torch.Tensor]:
        out: list = [None] * len(tensors)
        for idx, reduction in parts:
            for i, result in zip(idx, reduction.wait()):
                out[i] = _into(tensors[i], result) if in_place else result.to(tensors[i].device)
        return out

    return _handle([r._work for _, r in parts], finish)


@peer_errors
def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = _GLOBAL
) -> int:
    """``allgather``, started."""
    work, finish = gather(tensor, name, async_op=True, process_set=process_set)
    return _handle([work], finish)


@peer_errors
def grouped_allgather_async(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet = _GLOBAL
) -> int:
    """``allgather`` of each tensor, started; ``synchronize`` gives a list."""
    started = [gather(t, name, async_op=True, process_set=process_set) for t in tensors]
    return _handle([w for w, _ in started], lambda: [finish() for _, finish in started])


@peer_errors
def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet = _GLOBAL
) -> list:
    """``allgather`` of each tensor, as a list in the same order."""
    return synchronize(grouped_allgather_async(tensors, name, process_set))


@peer_errors
def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = _GLOBAL,
) -> int:
    """``broadcast``, started."""
    check_root(root_rank, name, process_set)
    started, work = broadcast_start(tensor, root_rank, process_set, name, async_op=True)
    return _handle([started], lambda: work.to(tensor.device))


@peer_errors
def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = _GLOBAL,
) -> int:
    """``broadcast_``, started: ``synchronize`` writes the root's tensor into ``tensor``."""
    check_root(root_rank, name, process_set)
    started, work = broadcast_start(tensor, root_rank, process_set, name, async_op=True)
    return _handle([started], lambda: _into(tensor, work))


@peer_errors
def sparse_allreduce_async(
    tensor: torch.Tensor, name: str | None = None, op=None, process_set: ProcessSet = _GLOBAL
) -> int:
    """The allreduce of a sparse tensor, started: every rank's indices and values gathered;
    ``synchronize`` gives the sparse sum (divided by the ranks with Average), uncoalesced."""
    op = reduce_op(op)
    if op not in (Average, Sum):
        raise ValueError(f"op{_named(name)}: a sparse allreduce sums or averages, not {op.name}")
    sparse = tensor.coalesce()
    world = scope(process_set, "sparse_allreduce").size
    indices = gather(sparse.indices().t().contiguous(), name, True, process_set, "sparse_allreduce")
    values = gather(sparse.values(), name, True, process_set, "sparse_allreduce")

    def finish() -> torch.Tensor:
        gathered = values[1]()
        if op == Average:
            gathered = gathered / world
        return torch.sparse_coo_tensor(indices[1]().t(), gathered, tensor.shape)

    return _handle([indices[0], values[0]], finish)


def _into(tensor: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return tensor.copy_(result)


# -- alltoall and reducescatter ---------------------------------------------------------
def _splits(rows: int, splits, world: int, name) -> list[int]:
    if splits is None:
        return [rows // world + (r < rows % world) for r in range(world)]
    counts = [int(s) for s in (splits.tolist() if torch.is_tensor(splits) else splits)]
    if len(counts) != world or any(c < 0 for c in counts) or sum(counts) != rows:
        raise ValueError(
            f"splits{_named(name)}: {world} counts >= 0 adding up to the tensor's {rows} "
            f"rows, got {counts}"
        )
    return counts


@peer_errors
def alltoall_async(
    tensor: torch.Tensor, splits=None, name: str | None = None, process_set: ProcessSet = _GLOBAL
) -> int:
    """``alltoall``, started; ``synchronize`` gives (output, received splits)."""
    info = rank_info()
    rows = tensor.shape[0] if tensor.dim() else 1
    work = tensor.detach().to(info.device).reshape(rows, -1).contiguous()
    send = _splits(rows, splits, scope(process_set, "alltoall").size, name)
    on = checked(process_set, "alltoall", name)
    counts = torch.tensor(send, dtype=torch.int64, device=info.device)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=on.group)  # rows each rank sends here
    recv = received.cpu().tolist()
    output = work.new_empty((sum(recv), work.shape[1]))
    started = dist.all_to_all_single(output, work, recv, send, group=on.group, async_op=True)

    def finish():
        shaped = output.reshape(sum(recv), *tensor.shape[1:]).to(tensor.device)
        return shaped, torch.tensor(recv, dtype=torch.int32)

    return _handle([started], finish)


class _Alltoall(torch.autograd.Function):
    """alltoall in autograd: the gradient goes back by the splits it came by."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.name, ctx.process_set = received, name, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, _):
        back, _ = synchronize(
            alltoall_async(grad.contiguous(), ctx.received, ctx.name, ctx.process_set)
        )
        return back, None, None, None


@peer_errors
def alltoall(
    tensor: torch.Tensor, splits=None, name: str | None = None, process_set: ProcessSet = _GLOBAL
):
    """Each rank's ``splits[r]`` rows of ``tensor`` sent to rank r (dim 0; without
    ``splits`` as equal as they go); what this rank received, in rank order, and with
    ``splits`` also the received counts (an int32 tensor), as Horovod's."""
    if tensor.requires_grad and torch.is_grad_enabled():
        output, received = _Alltoall.apply(tensor, splits, name, process_set)
    else:
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    return output if splits is None else (output, received)


@peer_errors
def reducescatter_async(
    tensor: torch.Tensor,
    name=None,
    op=Average,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set: ProcessSet = _GLOBAL,
) -> int:
    """``reducescatter``, started."""
    on = scope(process_set, "reducescatter")
    reduction = Reduction(
        [tensor],
        reduce_op(op),
        Compression.none,
        prescale_factor,
        postscale_factor,
        name,
        process_set,
    )
    rows = _splits(tensor.shape[0], None, on.size, name)
    start = sum(rows[: on.rank])

    def finish() -> torch.Tensor:
        reduced = reduction.wait()[0].to(tensor.device)
        return reduced.narrow(0, start, rows[on.rank]).clone()

    return _handle([reduction._work], finish)


@peer_errors
def reducescatter(
    tensor: torch.Tensor,
    name=None,
    op=Average,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set: ProcessSet = _GLOBAL,
) -> torch.Tensor:
    """The reduction (Average by default) of ``tensor`` over the ranks, of which this rank
    keeps its rows (dim 0 cut as equally as it goes, the first ranks one more)."""
    if tensor.dim() == 0:
        raise ValueError(f"reducescatter{_named(name)}: needs at least one dimension")
    return synchronize(
        reducescatter_async(tensor, name, op, prescale_factor, postscale_factor, process_set)
    )


@peer_errors
def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name=None,
    op=Average,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set: ProcessSet = _GLOBAL,
) -> int:
    """``reducescatter`` of each tensor, started together; ``synchronize`` gives a list."""
    for tensor in tensors:
        if tensor.dim() == 0:
            raise ValueError(f"grouped_reducescatter{_named(name)}: needs at least one dimension")
    started = [
        _pending.pop(
            reducescatter_async(t, name, op, prescale_factor, postscale_factor, process_set)
        )
        for t in tensors
    ]
    return _handle([w for o in started for w in o.works], lambda: [o.finish() for o in started])


@peer_errors
def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name=None,
    op=Average,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set: ProcessSet = _GLOBAL,
) -> list:
    """``reducescatter`` of each tensor, as a list in the same order."""
    return synchronize(
        grouped_reducescatter_async(
            tensors, name, op, prescale_factor, postscale_factor, process_set
        )
    )
