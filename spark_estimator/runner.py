"""Driver: ``run(fn, num_proc)``, a hand-written training function on every barrier task.

The Horovod-on-Spark way of working: ``fn`` runs once per rank inside an initialised
torch.distributed process group (gloo on CPU, NCCL on GPU) with the GPU Spark assigned
already pinned; inside it, ``spark_estimator.distributed`` gives rank, size,
device and collectives. Every input is checked before any Spark job starts.
"""

from __future__ import annotations

import base64
import functools
import io
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import cloudpickle
import torch
from pyspark.sql import SparkSession

from .driver.launch import available_slots, run_barrier_job
from .driver.monitor import print_lines_by_default, rank_lines, show_line
from .driver.validate import check_num_proc, check_positive
from .shared.failures import TrainingError, carried_failure
from .shared.serialization import dumps
from .shared.spec import COLLECTIVE_TIMEOUT_S
from .worker.run_task import run_task


def _payload(fn, args, kwargs) -> bytes:
    """fn, args and kwargs pickled together (shared objects stay shared); on a failure,
    pickled one by one to name the parameter at fault."""
    try:
        return cloudpickle.dumps((fn, args, kwargs))
    except Exception:
        for what, obj in (("fn", fn), ("args", args), ("kwargs", kwargs)):
            dumps(obj, what)
        raise


def _decode_result(text: str) -> Any:
    data = base64.b64decode(text)
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def run(
    fn: Callable,
    args: tuple | list = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    use_gpu: bool = True,
    spark: SparkSession | None = None,
    rank0_only: bool = False,
    collective_timeout: float = COLLECTIVE_TIMEOUT_S,
) -> list | Any:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` Spark barrier tasks, one rank each.

    ``num_proc`` defaults to every task slot of the cluster; ``spark`` to the active
    session. With ``use_gpu`` each rank pins the GPU Spark assigned to its task (a CPU
    fallback is reported by one warning on the driver). Returns the ranks' return values
    ordered by rank, or only rank 0's with ``rank0_only`` (the other ranks then send
    nothing back). Return values go through the driver's memory; tensors arrive on CPU.
    ``collective_timeout`` is how many seconds a rank waits for the others, to form the
    group and in each collective, before it raises. A rank whose ``fn`` raises (or calls
    ``sys.exit``) fails the job at once: ``run`` raises a ``TrainingError`` with that
    rank, its exception's type, message and traceback, and its last lines of output, as a
    fit does; unlike a fit, ``run`` does not retry (``fn`` owns its state). What the ranks
    print or log reaches the driver after the job, as ``[rank <r>] <line>`` on the
    ``spark_estimator.worker`` logger (also printed to stderr when no logging is
    configured for it).

    >>> def train(lr):
    ...     from spark_estimator import distributed as sd
    ...     return sd.allreduce(sd.rank() * lr, average=False)
    >>> run(train, args=(0.1,), num_proc=2)
    [0.1, 0.1]
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a function, got {type(fn).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args: expected a tuple or list, got {type(args).__name__}")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(f"kwargs: expected a dict of str keys, got {kwargs!r}")
    if num_proc is not None and (isinstance(num_proc, bool) or not isinstance(num_proc, int)):
        raise TypeError(f"num_proc: expected an int, got {type(num_proc).__name__}")
    if isinstance(collective_timeout, bool) or not isinstance(collective_timeout, (int, float)):
        raise TypeError(f"collective_timeout: expected seconds, got {collective_timeout!r}")
    check_positive("collective_timeout", float(collective_timeout))
    payload = _payload(fn, tuple(args), dict(kwargs))
    spark = spark if spark is not None else SparkSession.active()
    slots = available_slots(spark, num_proc)
    num_proc = slots if num_proc is None else num_proc
    check_num_proc(num_proc, slots)

    name = getattr(fn, "__qualname__", type(fn).__name__)
    try:
        summaries = run_barrier_job(
            spark,
            num_proc,
            functools.partial(
                run_task, payload, bool(use_gpu), bool(rank0_only), float(collective_timeout)
            ),
            f"spark-estimator run {name} on {num_proc} tasks",
        )
    except Exception as e:
        if (record := carried_failure(e)) is not None:
            output = rank_lines(record["rank"], record["output"])
            raise TrainingError(None, record, output) from e
        raise
    printed = print_lines_by_default()
    for s in summaries:
        for line in s["output"]:
            show_line(s["rank"], line, printed)
    notes: dict[str, list[int]] = {}
    for s in summaries:
        if s["device_note"]:
            notes.setdefault(s["device_note"], []).append(s["rank"])
    if notes:
        warnings.warn(
            "; ".join(f"ranks {ranks}: {note}" for note, ranks in notes.items()),
            stacklevel=2,
        )
    if rank0_only:
        return _decode_result(summaries[0]["result"])
    return [_decode_result(s["result"]) for s in summaries]
