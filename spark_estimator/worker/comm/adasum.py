"""Executor: Adasum, the adaptive sum of one tensor across the ranks of a process group.

Two gradients ``a`` and ``b`` combine as

    (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

so orthogonal gradients add, identical ones stay as they are (their average), and anything
in between is summed less its shared component. A zero vector contributes nothing: the other
passes through unchanged. Dot products and norms are taken in float64 whatever the tensor's
dtype (fp16 and bf16 included); the combination is computed in float64 too and cast back.

Across ``n`` ranks the combination runs along a recursive-doubling tree, per tensor:

- ``p`` is the largest power of two not above ``n``. First each rank ``r >= p`` sends its
  tensors to rank ``r - p``, which replaces its own by ``combine(own, received)`` (its own
  is the lower rank's, so it comes first).
- Then ranks ``0 .. p-1`` run ``log2(p)`` levels: at level ``k`` rank ``r`` exchanges its
  current tensors with rank ``r XOR 2^k`` and both compute ``combine(lower rank's, higher
  rank's)``. Both sides hold the same two operands and apply the same arithmetic, so after
  every level the ranks of a subtree hold bit-identical values.
- Last, rank ``r - p`` sends the result back to each rank ``r >= p``.

Tensors travel in their own dtype (the value is cast back after each combination), so every
rank ends with the same bits. Each exchange is a batch of point-to-point operations
(``dist.batch_isend_irecv``), which works on gloo and NCCL without ordering deadlocks.
NCCL needs a group's first batched point-to-point call to include all its ranks, while the
first step above leaves some out: the first call on a group therefore runs one small
all-reduce so the backend's communicator exists on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

_READY: set[int] = set()  # id() of the groups whose first collective has run here


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The Adasum of ``a`` (the lower rank's) and ``b``, computed in float64, in ``a``'s dtype."""
    a64, b64 = a.double(), b.double()
    dot = torch.dot(a64.flatten(), b64.flatten())
    a_sq = torch.dot(a64.flatten(), a64.flatten())
    b_sq = torch.dot(b64.flatten(), b64.flatten())
    # a zero vector's coefficient does not matter (it multiplies zeros): 1 keeps the other whole
    a_coef = torch.where(a_sq > 0, 1 - dot / (2 * a_sq.clamp_min(1e-300)), 1.0)
    b_coef = torch.where(b_sq > 0, 1 - dot / (2 * b_sq.clamp_min(1e-300)), 1.0)
    return (a_coef * a64 + b_coef * b64).to(a.dtype)


def adasum_allreduce_(tensors: Sequence[torch.Tensor], group=None) -> None:
    """Replace each tensor, in place, by the Adasum of that tensor over all ranks of ``group``
    (default: the world). A collective: every rank of the group calls it with tensors of the
    same shapes and dtypes, in the same order."""
    size = dist.get_world_size(group)
    if size == 1 or not tensors:
        return
    rank = dist.get_rank(group)
    _first_call(group)
    values = [t.detach().contiguous() for t in tensors]
    power = 1 << (size.bit_length() - 1)  # the largest power of two <= size
    if rank >= power:  # an extra rank: hand over to rank - power, get the result back
        _send(values, _peer(group, rank - power), group)
        _recv(values, _peer(group, rank - power), group)
    else:
        if rank + power < size:  # fold the extra rank's tensors into ours first
            theirs = _recv([torch.empty_like(v) for v in values], _peer(group, rank + power), group)
            values = [combine(mine, other) for mine, other in zip(values, theirs)]
        level = 1
        while level < power:
            partner = rank ^ level
            theirs = _exchange(values, _peer(group, partner), group)
            if rank < partner:
                values = [combine(mine, other) for mine, other in zip(values, theirs)]
            else:
                values = [combine(other, mine) for mine, other in zip(values, theirs)]
            level <<= 1
        if rank + power < size:
            _send(values, _peer(group, rank + power), group)
    for tensor, value in zip(tensors, values):
        if value.data_ptr() != tensor.data_ptr():  # not already received into it
            tensor.detach().copy_(value)


def _first_call(group) -> None:
    """One all-reduce on the group's first call here (see the module docstring)."""
    key = id(group if group is not None else dist.group.WORLD)
    if key in _READY:
        return
    probe = torch.zeros(1, device=_device(group))
    dist.all_reduce(probe, group=group)
    _READY.add(key)


def _device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _peer(group, group_rank: int) -> int:
    """The global rank that point-to-point calls take, for a rank of ``group``."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _send(values: list[torch.Tensor], peer: int, group) -> None:
    _wait([dist.P2POp(dist.isend, v, peer, group) for v in values])


def _recv(buffers: list[torch.Tensor], peer: int, group) -> list[torch.Tensor]:
    _wait([dist.P2POp(dist.irecv, b, peer, group) for b in buffers])
    return buffers


def _exchange(values: list[torch.Tensor], peer: int, group) -> list[torch.Tensor]:
    """Send ``values`` to ``peer`` and receive its tensors of the same shapes, in one batch."""
    theirs = [torch.empty_like(v) for v in values]
    ops = [dist.P2POp(dist.isend, v, peer, group) for v in values]
    ops += [dist.P2POp(dist.irecv, b, peer, group) for b in theirs]
    _wait(ops)
    return theirs


def _wait(ops: list[dist.P2POp]) -> None:
    for request in dist.batch_isend_irecv(ops):
        request.wait()
