"""Executor: ``hvd.start_timeline`` / ``hvd.stop_timeline``, a record of the collectives.

While a timeline runs, every collective of ``spark_estimator.horovod`` this rank calls
(allreduce, grouped_allreduce, allgather, broadcast, the objects' ones, barrier, join, and
the DistributedOptimizer's gradient allreduces, from their start to their completion) is
recorded as one complete event in Chrome's trace format (``chrome://tracing`` and Perfetto
open it): its name (the op and the tensor's ``name``), start and duration in microseconds,
the rank as the process. ``stop_timeline`` writes rank 0's events to the file given, as
Horovod's timeline is written by rank 0; every rank must call both, as Horovod's. Horovod's
``mark_cycles`` marks its background negotiation cycles, which do not exist here.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from collections.abc import Callable, Iterator

from .core import rank_info

_events: list[dict] | None = None  # recording while not None
_path: str | None = None


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record this rank's collectives until ``stop_timeline``; rank 0 writes them to
    ``file_path`` (its folder must exist)."""
    global _events, _path
    rank_info()  # after init(), as Horovod's
    if mark_cycles:
        raise ValueError(
            "mark_cycles: spark_estimator.horovod has no negotiation cycles to mark (its "
            "collectives run at once on torch.distributed); use mark_cycles=False"
        )
    folder = os.path.dirname(os.path.abspath(file_path))
    if not os.path.isdir(folder):
        raise ValueError(f"file_path: folder {folder!r} does not exist")
    _events, _path = [], file_path


def stop_timeline() -> None:
    """Stop recording; rank 0 writes the events to the file ``start_timeline`` named."""
    global _events, _path
    events, path = _events, _path
    _events = _path = None
    if events is None or rank_info().rank != 0:
        return
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


@contextlib.contextmanager
def recorded(op: str, name: str | None = None) -> Iterator[None]:
    """Record the block as one event of ``op`` while a timeline runs."""
    if _events is None:
        yield
        return
    started = time.perf_counter_ns()
    try:
        yield
    finally:
        if _events is not None:
            _events.append(event(op, name, started, time.perf_counter_ns()))


def event(op: str, name: str | None, started_ns: int, ended_ns: int) -> dict:
    """One complete event ("X") of Chrome's trace format."""
    return {
        "name": f"{op} {name}" if name else op,
        "cat": op,
        "ph": "X",
        "ts": started_ns / 1000,
        "dur": (ended_ns - started_ns) / 1000,
        "pid": rank_info().rank,
        "tid": 0,
    }


def add(op: str, name: str | None, started_ns: int) -> None:
    """Record an op that started at ``started_ns`` and ends now (an asynchronous one)."""
    if _events is not None:
        _events.append(event(op, name, started_ns, time.perf_counter_ns()))


def traced(op: str) -> Callable:
    """Decorate a collective whose ``name`` keyword (if any) names its tensor."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            with recorded(op, kwargs.get("name")):
                return fn(*args, **kwargs)

        return call

    return decorate
