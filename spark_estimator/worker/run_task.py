"""Executor: the barrier task behind ``spark_estimator.run``.

Each task records where it runs (``RunFolder.process``: rank, host, pid, launch and task
attempt), joins the job's process group and runs the user's function, or a script as
``__main__`` (``run_script``), with ``run``'s ``env`` set. It returns a summary with its
rank, its CPU-fallback note, the function's return value and whether it stopped for the
job to grow (``EndLaunchToGrow``). The value is written with
``torch.save`` through cloudpickle (any picklable object; tensors are stored so that the
driver can map CUDA tensors to CPU) and travels base64-encoded inside the summary.

What the rank prints or logs reaches the run's folder in the store while it runs
(``run_log.RankLog``), where the driver reads it. Failures are ordered and ranks leave
together in ``rendezvous.process_group``; the first failing rank's exception is recorded
in the run's ``failures/<launch>.json`` (unless it only says that a peer went away, see
``is_peer_failure``); a rank's own error (not a peer's loss) also carries its record and
last ``NOTE_LINES`` lines in a note (``failures.carry_failure``), which Spark's error shows
even where the driver cannot read the store.
"""

from __future__ import annotations

import base64
import io
import os
import runpy
import socket
import sys
import tempfile
from dataclasses import dataclass, field

import cloudpickle
import torch

from ..shared.failures import carry_failure, is_peer_failure, record_failure
from ..shared.serialization import loads
from ..shared.spec import launch_secret
from ..store import Store
from .comm.meeting import Meeting
from .comm.rendezvous import process_group
from .environ import environ
from .observe.run_log import RankLog

NOTE_LINES = 20  # the most of a failing rank's last lines carried in its error


@dataclass(frozen=True)
class RunSpec:
    """One launch of ``run``: what every task runs, and where the run's folder is."""

    payload: bytes | None  # cloudpickled (fn, args, kwargs); None for a script
    script: tuple[str, str, tuple[str, ...]] | None  # (path as given, its source, args)
    env: dict[str, str]
    use_gpu: bool | str  # as TrainSpec.use_gpu
    rank0_only: bool
    collective_timeout: float
    store: Store
    run_id: str
    launch_id: str
    verbose: int
    # the ranks' lines also go to the tasks' own stdout and stderr; not where those are
    # the driver's terminal (local masters), which shows them from the store already
    echo: bool
    secret: str = field(default_factory=launch_secret, repr=False)  # seals the job's TCPStore


_current: RunSpec | None = None


class EndLaunchToGrow(BaseException):
    """Raised through the user's code on every rank by ``hvd.elastic.run`` when the driver
    asked the job to grow (see ``hvd.elastic``): the task ends without an error, its
    summary says ``paused``, and the driver starts the job again larger. A BaseException,
    as ``SystemExit``, so that a script's ``except Exception`` lets it through."""


def current_run() -> RunSpec | None:
    """The launch this process runs a rank of (inside a ``run`` task), or None."""
    return _current


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


def run_script(path: str, source: str, args: tuple[str, ...]) -> None:
    """Run ``source`` (the script ``path`` read on the driver) as ``__main__`` with
    ``sys.argv = [path, *args]``, from a copy in a temporary folder. ``sys.exit(0)`` or
    ``sys.exit()`` is success; any other exit raises its ``SystemExit``."""
    argv = sys.argv
    with tempfile.TemporaryDirectory(prefix="spark-estimator-script-") as folder:
        copy = os.path.join(folder, os.path.basename(path))
        with open(copy, "w", encoding="utf-8") as f:
            f.write(source)
        sys.argv = [path, *args]
        try:
            runpy.run_path(copy, run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):
                raise
        finally:
            sys.argv = argv


def run_task(spec: RunSpec) -> dict:
    """Run one rank of the launch ``spec``; return its summary. With ``rank0_only`` the
    other ranks send no value back (``result`` is None); a script's value is None, and so
    is that of a launch that ended for the job to grow (``paused``)."""
    global _current
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    store, run = spec.store, spec.store.run(spec.run_id)
    rank, attempt = ctx.partitionId(), ctx.taskAttemptId()
    host, pid = socket.gethostname(), os.getpid()
    store.write_json(
        run.process(rank),
        {"rank": rank, "host": host, "pid": pid, "launch_id": spec.launch_id, "attempt": attempt},
    )

    def on_failure(rank: int, error: BaseException) -> None:
        record_failure(run.failure(spec.launch_id), store, rank, error)

    with RankLog(store, spec.run_id, spec.launch_id, rank, attempt, spec.echo) as log:
        try:
            _current = spec
            call = loads(spec.payload) if spec.script is None else None
            with (
                process_group(
                    ctx,
                    Meeting(store, run, spec.launch_id, spec.secret),
                    spec.use_gpu,
                    spec.collective_timeout,
                    on_failure,
                    spec.script is None,
                    on_error=log.write_now,
                ) as info,
                environ(spec.env),
            ):
                if spec.verbose >= 2:
                    print(
                        f"spark-estimator: rank {rank} of {info.world_size} on {host}, pid "
                        f"{pid}, device {info.device}, task attempt {attempt}",
                        file=sys.stderr,
                    )
                paused, value = False, None
                try:
                    if spec.script is not None:
                        run_script(*spec.script)
                    else:
                        fn, args, kwargs = call
                        value = fn(*args, **kwargs)
                except EndLaunchToGrow:
                    paused = True  # every rank ends this launch here, together
            send = spec.script is None and not paused and (rank == 0 or not spec.rank0_only)
            result = encode_result(value, rank) if send else None
        except BaseException as e:
            if not is_peer_failure(e):  # only says that another rank failed or was lost
                carry_failure(e, rank, list(log.tail)[-NOTE_LINES:])
            raise
        finally:
            _current = None
    return {"rank": rank, "device_note": info.device_note, "result": result, "paused": paused}
