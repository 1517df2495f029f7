"""Executor: the barrier task behind ``spark_estimator.run``.

Each task joins the job's process group, calls the user's function, and returns a summary
with its rank, its CPU-fallback note and its return value. The value is written with
``torch.save`` through cloudpickle (any picklable object; tensors are stored so that the
driver can map CUDA tensors to CPU) and travels base64-encoded inside the summary.

Failures are ordered and ranks leave together in ``rendezvous.process_group``. What the
rank prints or logs (``run_log.OutputCapture``) goes back with the summary, its last
``OUTPUT_LINES`` lines. A failing rank's exception carries its failure record and last
``NOTE_LINES`` lines in a note (``failures.carry_failure``), from which the driver raises a
``TrainingError``.
"""

from __future__ import annotations

import base64
import collections
import io

import cloudpickle
import torch

from ..shared.failures import carry_failure
from ..shared.serialization import loads
from .comm.rendezvous import process_group
from .observe.run_log import OutputCapture

OUTPUT_LINES = 1000  # the most lines of a rank's output sent back to the driver
NOTE_LINES = 20  # the most of them shown in a failing rank's error


def encode_result(value, rank: int) -> str:
    """``value`` as base64 text; a TypeError naming the rank when it cannot be pickled."""
    buf = io.BytesIO()
    try:
        torch.save(value, buf, pickle_module=cloudpickle)
    except Exception as e:  # pickling raises many types (TypeError, PicklingError, ...)
        raise TypeError(
            f"fn: the return value on rank {rank} ({type(value).__name__}) cannot be "
            f"serialized with cloudpickle ({type(e).__name__}: {e}); return values are "
            "sent back to the driver"
        ) from e
    return base64.b64encode(buf.getvalue()).decode("ascii")


def run_task(payload: bytes, use_gpu: bool, rank0_only: bool, timeout_s: float) -> dict:
    """Run one rank of ``fn(*args, **kwargs)`` (cloudpickled in ``payload``); return its
    summary. With ``rank0_only`` the other ranks send no value back (``result`` is None)."""
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    fn, args, kwargs = loads(payload)
    output: collections.deque[str] = collections.deque(maxlen=OUTPUT_LINES)
    try:
        with OutputCapture(output.append), process_group(ctx, use_gpu, timeout_s) as info:
            value = fn(*args, **kwargs)
        result = encode_result(value, info.rank) if info.rank == 0 or not rank0_only else None
    except BaseException as e:
        carry_failure(e, ctx.partitionId(), list(output)[-NOTE_LINES:])
        raise
    return {
        "rank": info.rank,
        "device_note": info.device_note,
        "result": result,
        "output": list(output),
    }
