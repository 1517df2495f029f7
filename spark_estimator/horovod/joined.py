"""Executor: ``hvd.join()``, and the control round that lets joined ranks take part in the
others' allreduces.

A rank that called ``join()`` keeps taking part in the allreduces of the ranks that have
not, contributing zeros (an Average still divides by the job's size), until every rank
has joined, as Horovod's. For that, every collective on the whole job (the global process
set) first starts a small control allreduce, a SUM of

    [1 (an active rank), kind, op, dtype, numel, arrival of rank 0, ..., of rank size-1]

from each active rank and ``[0, 0, 0, 0, 0, arrivals]`` from each joined one (its place
in the order of ``join()`` calls, from the job's store, in its own slot). The ranks start
their collectives in the same order, so each control round meets the same round on every
rank, joined ranks included. An allreduce starts its data collective right after its
control round, both asynchronously (``*_async`` returns at once); a joined rank reads the
kind, op, dtype and size from the round's sum (divided by the number of active ranks)
and contributes zeros of that dtype and size to the data allreduce (for Min, Max and
Product the op's identity: the largest value, the lowest, one, so the result is that of
the active ranks). When the round's active count is 0 every rank has joined: ``join()``
returns the rank whose arrival is last.

Horovod supports only allreduces while ranks are joined. Any other collective (allgather,
broadcast, alltoall, the object collectives, barrier, an Adasum allreduce) waits for its
control round first, and where ranks have joined it raises a RuntimeError naming the op
and the joined ranks, on every rank (the joined ones raise from ``join()``): nothing
hangs. Collectives on a process set other than the global one have no control round:
a set's rank that is waiting in ``join()`` takes no part in them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .core import TORCH_OPS, ReduceOp, rank_info

KINDS = (
    "allreduce",
    "allgather",
    "broadcast",
    "alltoall",
    "broadcast_object",
    "allgather_object",
    "barrier",
    "sparse_allreduce",
)
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_ACTIVE, _KIND, _OP, _DTYPE, _NUMEL, _ARRIVALS = 0, 1, 2, 3, 4, 5


class Control:
    """A control round in flight (None where the job has one rank: nobody can join)."""

    def __init__(self, kind: str, op: int = 0, dtype: torch.dtype | None = None, numel: int = 0):
        info = rank_info()
        self.kind, self.op = kind, op
        if dtype is not None and dtype not in DTYPES:
            names = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
            raise TypeError(f"{kind}: tensors of dtype {dtype} are not reduced (only {names})")
        code = DTYPES.index(dtype) + 1 if dtype is not None else 0
        self._vector = torch.zeros(_ARRIVALS + info.world_size, dtype=torch.int64)
        self._vector[:_ARRIVALS] = torch.tensor([1, KINDS.index(kind) + 1, op + 1, code, numel])
        self._vector = self._vector.to(info.device)
        self._work = dist.all_reduce(self._vector, async_op=True)

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None

    def joined(self) -> list[int]:
        """The ranks that had joined at this round (waits for it)."""
        self.wait()
        arrivals = self._vector[_ARRIVALS:].cpu()
        return [r for r, a in enumerate(arrivals.tolist()) if a > 0]

    def require_all_active(self, name: str | None = None) -> None:
        """Raise (on every rank) where ranks have joined: ``kind`` cannot run with them."""
        joined = self.joined()
        if joined:
            what = _what(self.kind, self.op)
            raise RuntimeError(_refusal(what, name, joined, rank_info().world_size))


def announce(kind: str, op: int = 0, dtype: torch.dtype | None = None, numel: int = 0):
    """Start the control round of a collective on the whole job (None with one rank)."""
    if rank_info().world_size == 1:
        return None
    return Control(kind, op, dtype, numel)


def require_all_active(kind: str, name: str | None = None, op: int = 0) -> None:
    """The control round of a collective that joined ranks cannot take part in: waits
    for it, and raises where ranks have joined."""
    control = announce(kind, op)
    if control is not None:
        control.require_all_active(name)


def _what(kind: str, op: int) -> str:
    return "allreduce with op=Adasum" if kind == "allreduce" and op == ReduceOp.ADASUM else kind


def _refusal(kind: str, name: str | None, joined: list[int], world: int) -> str:
    what = f"{kind} (tensor {name!r})" if name else kind
    active = [r for r in range(world) if r not in joined]
    return (
        f"{what} called by ranks {active} while ranks {joined} had called hvd.join(): "
        "joined ranks take part only in allreduces (not Adasum), as Horovod's; call "
        "this collective before join() on every rank"
    )


def join() -> int:
    """Wait until every rank has called ``join()``, meanwhile taking part in the other
    ranks' allreduces with zeros; the rank that called it last."""
    info = rank_info()
    if info.world_size == 1:
        return info.rank
    store = dist.distributed_c10d._get_default_store()
    call = _count(store, f"spark_estimator.horovod/join/calls/{info.rank}")
    arrival = _count(store, f"spark_estimator.horovod/join/{call}")
    mine = torch.zeros(_ARRIVALS + info.world_size, dtype=torch.int64)
    mine[_ARRIVALS + info.rank] = arrival
    mine = mine.to(info.device)
    while True:
        vector = mine.clone()
        dist.all_reduce(vector)
        v = vector.cpu().tolist()
        active = v[_ACTIVE]
        if active == 0:
            arrivals = v[_ARRIVALS:]
            return arrivals.index(max(arrivals))
        if any(v[i] % active for i in (_KIND, _OP, _DTYPE, _NUMEL)):
            raise RuntimeError(
                f"hvd.join() on rank {info.rank}: the other ranks called different "
                "collectives at once (a control round summed to "
                f"{v[:_ARRIVALS]} over {active} ranks)"
            )
        kind, op, dtype = (v[i] // active - 1 for i in (_KIND, _OP, _DTYPE))
        numel = v[_NUMEL] // active
        joined = [r for r, a in enumerate(v[_ARRIVALS:]) if a > 0]
        if KINDS[kind] != "allreduce" or op == ReduceOp.ADASUM:  # joined ranks cannot take part
            raise RuntimeError(_refusal(_what(KINDS[kind], op), None, joined, info.world_size))
        op = ReduceOp(op)
        filler = _identity(op.name, DTYPES[dtype], numel, info.device)
        dist.all_reduce(filler, op=TORCH_OPS[op])


def _count(store, key: str) -> int:
    """Add 1 to ``key``'s counter in the job's store. In a fit or ``run(fn)`` the counters
    are sealed (``SealedStore``: one a stranger wrote raises ``ForgedValue``); a script's
    group has torch's plain store, whose error (its server went away, or a stranger wrote
    a value that is not a number: the server then drops the connection, though a few such
    adds in a hundred return 1 instead) is told what the counter was."""
    try:
        return store.add(key, 1)
    except dist.DistError as e:
        if hasattr(e, "add_note"):  # Python 3.11+
            e.add_note(
                f"hvd.join(): the job's store did not add to the counter {key!r}: rank 0's "
                "process, which serves the store, went away, or a process outside the job "
                "that reached the store's port wrote there a value that is not a number"
            )
        raise


def _identity(op: str, dtype: torch.dtype, numel: int, device) -> torch.Tensor:
    """What a joined rank contributes: zeros (Sum, Average), else ``op``'s identity."""
    if op in ("SUM", "AVERAGE"):
        return torch.zeros(numel, dtype=dtype, device=device)
    if op == "PRODUCT":
        return torch.ones(numel, dtype=dtype, device=device)
    if dtype == torch.bool:
        return torch.full((numel,), op == "MIN", dtype=dtype, device=device)
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    value = info.max if op == "MIN" else info.min
    if dtype.is_floating_point:
        value = float("inf") if op == "MIN" else float("-inf")
    return torch.full((numel,), value, dtype=dtype, device=device)
