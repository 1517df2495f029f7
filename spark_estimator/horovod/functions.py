"""Executor: Horovod's start-of-training broadcasts: the model's parameters and the
optimizer's state, from one rank to all."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from .basics import rank
from .collectives import broadcast_object, broadcast_tensors_, check_root
from .errors import peer_errors
from .process_sets import ProcessSet, global_process_set


@peer_errors
def broadcast_parameters(
    params: Mapping | Iterable, root_rank: int, process_set: ProcessSet = global_process_set
) -> None:
    """Overwrite ``params`` with ``root_rank``'s on the ranks of ``process_set``.

    A collective: every rank of ``process_set`` calls it (one broadcast per dtype among the
    tensors), typically once before training so that every rank starts from the same
    weights.

    Parameters
    ----------
    params : dict or iterable
        A ``state_dict()`` (its tensors share the model's storage, so the model is
        updated), ``named_parameters()`` or a list of tensors; written in place.
    root_rank : int
        The rank whose values are sent: a global rank (``hvd.rank()``), as Horovod's.
    process_set : hvd.ProcessSet, default hvd.global_process_set
        The ranks that take part.

    Raises
    ------
    TypeError
        ``params`` is not a mapping or an iterable of tensors (or of (name, tensor) pairs).
    ValueError
        ``root_rank`` is not a rank of ``process_set``; before ``hvd.init()``.
    HorovodInternalError
        Another rank failed, died or hung during the broadcast.

    Examples
    --------
    >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)       # doctest: +SKIP
    """
    if isinstance(params, Mapping):
        items = sorted(params.items())
    elif isinstance(params, Iterable) and not isinstance(params, torch.Tensor):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise TypeError(
            f"params: expected a state_dict or named_parameters(), got {type(params).__name__}"
        )
    for name, value in items:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"params: {name!r} is of type {type(value).__name__}, not a tensor")
    broadcast_tensors_([value for _, value in items], root_rank, process_set)


@dataclass(frozen=True)
class _Slot:
    """Where a tensor of the root's optimizer state goes (it travels on its own)."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@peer_errors
def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, process_set: ProcessSet = global_process_set
) -> None:
    """Give every rank of ``process_set`` ``root_rank``'s optimizer state.

    The state and the parameter-group settings (``lr``, momentum, ...), including state the
    optimizer creates on its first step: the other ranks load the root's ``state_dict()``.
    An optimizer without state yet (none has stepped) first takes one local step on zero
    gradients, which creates it, as Horovod's does (the parameters' ``.grad`` stay zeros;
    a step on zeros still applies weight decay, as Horovod's). A collective: every rank of
    ``process_set`` calls it.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        The optimizer (or a ``DistributedOptimizer``); updated in place.
    root_rank : int
        The rank whose state is sent: a global rank (``hvd.rank()``), as Horovod's.
    process_set : hvd.ProcessSet, default hvd.global_process_set
        The ranks that take part.

    Raises
    ------
    TypeError
        ``optimizer`` is not a ``torch.optim.Optimizer``.
    ValueError
        ``root_rank`` is not a rank of ``process_set``; before ``hvd.init()``.
    HorovodInternalError
        Another rank failed, died or hung during the broadcast.

    Examples
    --------
    >>> hvd.broadcast_optimizer_state(optimizer, root_rank=0)           # doctest: +SKIP
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer)}")
    check_root(root_rank, None, process_set)
    if not optimizer.state:
        _create_state(optimizer)
    tensors: list[torch.Tensor] = []

    def strip(value):
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return _Slot(len(tensors) - 1, tuple(value.shape), value.dtype)
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(strip(v) for v in value)
        return value

    is_root = rank() == root_rank
    skeleton = broadcast_object(
        strip(optimizer.state_dict()) if is_root else None, root_rank, process_set=process_set
    )
    if not is_root:
        tensors.clear()
        state = _fill(skeleton, tensors)
    broadcast_tensors_(tensors, root_rank, process_set)
    if not is_root:
        optimizer.load_state_dict(state)


def _fill(value, tensors: list[torch.Tensor]):
    """``value`` with each slot replaced by a new tensor of its shape (appended to
    ``tensors`` in slot order, ready to receive the root's)."""
    if isinstance(value, _Slot):
        tensors.append(torch.empty(value.shape, dtype=value.dtype))
        return tensors[-1]
    if isinstance(value, dict):
        return {k: _fill(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_fill(v, tensors) for v in value)
    return value


def _create_state(optimizer: torch.optim.Optimizer) -> None:
    """One step of the user's optimizer on zero gradients, without any reduction (a
    DistributedOptimizer's would be a collective the ranks do not all make here)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    local = next(
        (k for k in type(optimizer).__mro__ if not k.__module__.startswith(__package__)),
        type(optimizer),
    )
    local.step(optimizer)
