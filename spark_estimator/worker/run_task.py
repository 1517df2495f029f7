"""Executor: the barrier task behind ``spark_estimator.run``.

Each task records where it runs (``RunFolder.process``: rank, host, pid, launch and task
attempt), joins the job's process group, its ranks numbered host by host as torchrun's
(``ranks.ranks_by_host``), and runs the user's function, or a script as ``__main__``
(``run_script``), with ``run``'s ``env`` set. It returns a summary with its
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
import contextlib
import io
import linecache
import os
import socket
import sys
import tempfile
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import cloudpickle
import torch

from ..shared.failures import carry_failure, is_peer_failure, record_failure
from ..shared.serialization import loads
from ..shared.spec import launch_secret
from ..store import Store
from .comm.meeting import Meeting
from .comm.ranks import job_ranks
from .comm.rendezvous import process_group
from .environ import environ
from .observe.run_log import RankLog

NOTE_LINES = 20  # the most of a failing rank's last lines carried in its error


@dataclass(frozen=True)
class Script:
    """A script ``run`` runs, read on the driver."""

    path: str  # as given: its sys.argv[0]
    file: str  # its absolute path on the driver: its __file__
    source: str
    args: tuple[str, ...] = ()
    # the .py files beside it (their bytes by name), for executors that do not see the
    # driver's filesystem; none where they do (local masters)
    modules: Mapping[str, bytes] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class RunSpec:
    """One launch of ``run``: what every task runs, and where the run's folder is."""

    payload: bytes | None  # cloudpickled (fn, args, kwargs); None for a script
    script: Script | None
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


def run_script(script: Script) -> None:
    """Run ``script`` as ``__main__``, as ``python <script>`` (and torchrun) would:
    ``sys.argv = [path as given, *args]``, ``__file__`` its absolute path on the driver,
    and its folder first on ``sys.path``, so that the modules beside it import. Where the
    script lies at that path on this machine too (a local master, a shared filesystem) that
    folder is the one on ``sys.path``; elsewhere a temporary folder holding the modules the
    driver shipped (``Script.modules``). Both leave ``sys.path`` after the script, and so do
    the modules imported from them (PySpark reuses its Python workers). ``sys.exit(0)`` or
    ``sys.exit()`` is success; any other exit raises its ``SystemExit``."""
    with _script_folder(script) as folder:
        before = set(sys.modules)
        argv, path = sys.argv, list(sys.path)
        sys.argv = [script.path, *script.args]
        sys.path.insert(0, folder)
        try:
            _run_main(script.file, script.source)
        except SystemExit as e:
            if e.code not in (None, 0):
                raise
        finally:
            sys.argv, sys.path[:] = argv, path
            inside = os.path.join(folder, "")
            for name in set(sys.modules) - before:
                if (getattr(sys.modules[name], "__file__", None) or "").startswith(inside):
                    del sys.modules[name]


@contextlib.contextmanager
def _script_folder(script: Script) -> Iterator[str]:
    """The folder whose modules the script imports: its own, where the same script lies at
    its path here; else a temporary one with the modules shipped beside it."""
    try:
        with open(script.file, encoding="utf-8") as f:
            here = f.read() == script.source
    except (OSError, ValueError):
        here = False
    if here:
        yield os.path.dirname(script.file)
        return
    with tempfile.TemporaryDirectory(prefix="spark-estimator-script-") as folder:
        for name, data in script.modules.items():
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
        yield folder


def _run_main(file: str, source: str) -> None:
    """Run ``source`` as the module ``__main__`` of file ``file``, as Python runs a script
    (``sys.modules["__main__"]`` is that module meanwhile, so that its classes pickle);
    a traceback shows its lines also where ``file`` is not on this machine."""
    code = compile(source, file, "exec", dont_inherit=True)
    linecache.cache[file] = (len(source), None, source.splitlines(True), file)  # kept
    module = types.ModuleType("__main__")
    module.__file__ = file
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)
    finally:
        if main is None:
            sys.modules.pop("__main__", None)
        else:
            sys.modules["__main__"] = main


def run_task(spec: RunSpec) -> dict:
    """Run one rank of the launch ``spec``; return its summary. With ``rank0_only`` the
    other ranks send no value back (``result`` is None); a script's value is None, and so
    is that of a launch that ended for the job to grow (``paused``)."""
    global _current
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    store, run = spec.store, spec.store.run(spec.run_id)
    rank, attempt = job_ranks(ctx, by_host=True)[0], ctx.taskAttemptId()
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
                    ranks_by_host=True,
                    run_id=spec.run_id,
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
                        run_script(spec.script)
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
