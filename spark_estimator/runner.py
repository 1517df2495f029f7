"""Driver: ``run(fn, num_proc)`` or ``run("train.py", args)``: a hand-written training
function, or an unmodified script, on every barrier task.

The Horovod-on-Spark way of working: ``fn`` runs once per rank inside an initialised
torch.distributed process group (gloo on CPU, NCCL on GPU) with the GPU Spark assigned
already pinned; inside it, ``spark_estimator.distributed`` gives rank, size,
device and collectives. A script runs as ``__main__`` with torchrun's variables set (ranks
numbered host by host, as torchrun's) and the modules beside it importable, and forms the
group itself (``hvd.init()`` or ``init_process_group``). The ranks' output
comes back through the run's folder in a store while they run (``FitMonitor``); a launch
whose ranks entered ``hvd.elastic.run`` is started again after a lost rank, and with more
ranks when the cluster offers more slots (``hvd.elastic``, ``ElasticSize``). Every input is
checked before any Spark job starts.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import io
import logging
import os
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import cloudpickle
import torch
from pyspark.sql import SparkSession

from .driver.elastic import (
    ELASTIC_TIMEOUT_S,
    MAX_RESTARTS,
    ElasticSize,
    lost_reason,
    request_growth,
)
from .driver.launch import (
    SLOT_WAIT_S,
    available_slots,
    cancel_jobs,
    is_connect,
    run_barrier_job,
    tasks_print_here,
)
from .driver.monitor import FitMonitor, print_lines_by_default, rank_lines, show_line
from .driver.param_specs import to_use_gpu
from .driver.stage_profile import task_profile
from .driver.task_python import check_task_python
from .driver.validate import check_min_num_proc, check_num_proc, check_positive, check_use_gpu
from .shared.failures import TrainingError, carried_failure, read_failure
from .shared.serialization import dumps
from .shared.spec import COLLECTIVE_TIMEOUT_S
from .store import Store
from .worker.run_task import RunSpec, Script, run_task

log = logging.getLogger(__name__)

MODULES_MAX_BYTES = 2 << 20  # the most of the .py modules beside a script that run() ships


class _LostRank(Exception):
    """A launch of an elastic run failed without an error of the training code."""


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


def _read_script(fn, args, kwargs) -> Script:
    path = os.fspath(fn)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"fn: no script file at {path!r}")
    if not all(isinstance(a, str) for a in args):
        raise TypeError(f"args: a script's arguments must be strings, got {list(args)!r}")
    if kwargs:
        raise TypeError("kwargs: a script takes no kwargs; pass its command line in args")
    with open(path, encoding="utf-8") as f:
        return Script(path, os.path.abspath(path), f.read(), tuple(args))


def _modules_beside(file: str) -> dict[str, bytes]:
    """The ``.py`` files in the folder of the script ``file`` (not the script itself, nor
    subfolders), their bytes by name: what a task that does not see this filesystem needs
    to import what lies beside the script. A ValueError naming the largest where they hold
    more than ``MODULES_MAX_BYTES`` together (they travel inside the job's tasks)."""
    folder = os.path.dirname(file)
    names = sorted(
        name
        for name in os.listdir(folder)
        if name.endswith(".py")
        and name != os.path.basename(file)
        and os.path.isfile(os.path.join(folder, name))
    )
    sizes = {name: os.path.getsize(os.path.join(folder, name)) for name in names}
    if sum(sizes.values()) > MODULES_MAX_BYTES:
        largest = sorted(sizes, key=lambda name: -sizes[name])[:5]
        raise ValueError(
            f"fn: the .py modules beside the script in {folder} hold {_size(sum(sizes.values()))}"
            f" ({', '.join(f'{n} {_size(sizes[n])}' for n in largest)}"
            f"{', ...' if len(names) > len(largest) else ''}), more than the "
            f"{_size(MODULES_MAX_BYTES)} shipped to executors that do not see this machine's "
            "files; put the script in a folder with only the modules it imports, or ship "
            "them as a zip (SparkContext.addPyFile, spark-estimator-run --py-files)"
        )
    modules = {}
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            modules[name] = f.read()
    return modules


def _size(n: int) -> str:
    return f"{n} B" if n < 1 << 10 else f"{n / (1 << 10):.0f} KiB"


def _tasks_see_this_machine(spark) -> bool:
    """Whether the job's tasks run on this machine (``local``, ``local[N]`` and
    ``local-cluster`` masters), and so see its files; not so on Spark Connect."""
    return not is_connect(spark) and spark.sparkContext.master.startswith("local")


def _check_seconds(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected seconds, got {value!r}")
    check_positive(name, float(value))
    return float(value)


def _check_count(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return value


def _check_stream(name: str, stream) -> None:
    if stream is not None and not callable(getattr(stream, "write", None)):
        raise TypeError(f"{name}: expected a file-like object with write(), got {stream!r}")


def _check_env(env) -> dict[str, str]:
    env = {} if env is None else env
    if not isinstance(env, Mapping) or not all(
        isinstance(k, str) and k and "=" not in k and isinstance(v, str) for k, v in env.items()
    ):
        raise TypeError(f"env: expected a dict of variable names to str values, got {env!r}")
    return dict(env)


def _run_store(store) -> tuple[Store, str | None]:
    """The run's store and, for the default one (a fresh temporary folder), its path."""
    if store is None:
        folder = tempfile.mkdtemp(prefix="spark-estimator-run-")
        return Store.create(folder), folder
    return (Store.create(store) if isinstance(store, str) else store), None


def _shower(stdout, stderr, verbose: int) -> Callable[[int, str, str], None]:
    """How a rank's line is shown: written, as ``[rank <r>] <line>``, to ``stdout`` or
    ``stderr`` by its stream; where that is None, logged (and printed to stderr with
    ``verbose`` when no logging is configured) as a fit does."""
    printed = verbose >= 1 and print_lines_by_default()

    def show(rank: int, stream: str, line: str) -> None:
        target = stdout if stream == "stdout" else stderr
        if target is None:
            show_line(rank, line, printed)
            return
        target.write(f"[rank {rank}] {line}\n")
        if callable(getattr(target, "flush", None)):
            target.flush()

    return show


def run(
    fn: Callable | str | os.PathLike,
    args: tuple | list = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    use_gpu: bool | str = "auto",
    spark: SparkSession | None = None,
    rank0_only: bool = False,
    collective_timeout: float = COLLECTIVE_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
    stdout=None,
    stderr=None,
    start_timeout: float = SLOT_WAIT_S,
    verbose: int = 1,
    store: Store | str | None = None,
    run_id: str | None = None,
    max_restarts: int = MAX_RESTARTS,
    min_num_proc: int | None = None,
    elastic_timeout: float = ELASTIC_TIMEOUT_S,
    stage_level_scheduling: bool = True,
    max_num_proc: int | None = None,
) -> list | Any:
    """Run a training function, or an unmodified script, on Spark barrier tasks, one rank each.

    ``fn(*args, **kwargs)``, or the script ``fn`` with ``args``, runs once per rank on
    ``num_proc`` Spark barrier tasks: the Horovod-on-Spark way of working. A function runs
    inside the job's initialised torch.distributed process group (gloo on CPU, NCCL on GPU)
    with the GPU Spark assigned already pinned; inside it, ``spark_estimator.distributed``
    gives rank, size, device and collectives. A script forms the group itself. What the
    ranks print reaches the driver while they run. Every input is checked before any Spark
    job starts.

    Parameters
    ----------
    fn : callable, str or os.PathLike
        A function, or the path of a Python script. The script is read here and shipped, so
        executors need not see this filesystem, and runs as ``__main__`` as ``python fn``
        runs it: ``sys.argv = [fn, *args]``, ``__file__`` its absolute path here, and its
        folder first on ``sys.path`` (where the script lies at that path on the executor
        too, else a temporary folder with the ``.py`` files beside it, which are shipped
        when the tasks do not run on this machine: at most ``MODULES_MAX_BYTES``, 2 MiB,
        else a ValueError names the largest; subfolders and other files travel with
        ``SparkContext.addPyFile`` / ``addFile``). It forms the process group itself
        (``hvd.init()``, or ``torch.distributed.init_process_group()`` from torchrun's
        variables set on each rank: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
        ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_RANK``,
        ``ROLE_WORLD_SIZE``, ``ROLE_NAME``, ``TORCHELASTIC_RUN_ID`` (``run_id``),
        ``MASTER_ADDR``, ``MASTER_PORT``; docs/horovod.md). ``sys.exit(0)`` ends a script
        successfully.
    args : tuple or list, optional
        The function's positional arguments, or the script's command line (strings).
    kwargs : dict, optional
        The function's keyword arguments (str keys); a script takes none.
    num_proc : int, optional
        The number of ranks the job starts with (Horovod's ``-np``). By default every task
        slot of the cluster (at most ``max_num_proc``).
    use_gpu : bool or "auto", default "auto"
        With ``"auto"`` each rank pins the GPU Spark assigned to its task, and runs on the
        CPU where the cluster has no GPUs configured (where it has, a rank that got none is
        reported by one warning on the driver). True requires a GPU for every rank (a
        ValueError before any job where Spark gives tasks none); False is the CPU.
    spark : pyspark.sql.SparkSession, optional
        The session whose cluster runs the job; by default the active session.
    rank0_only : bool, default False
        Return rank 0's return value only; the other ranks then send nothing back.
    collective_timeout : float, default 600.0
        How many seconds a rank waits for the others, to form the group and in each
        collective, before it raises.
    env : dict of str to str, optional
        Environment variables set on every rank before ``fn`` runs.
    stdout, stderr : file-like, optional
        Objects with ``write()`` that receive the ranks' lines, each as ``[rank <r>]
        <line>``: ``stdout`` the ranks' stdout, ``stderr`` their stderr and logging. Where
        one is None, its lines are logged on the ``spark_estimator.worker`` logger and,
        with ``verbose`` >= 1 and no logging configured for it, printed to stderr.
    start_timeout : float, default 30.0
        How many seconds to wait for the executors of a cluster to offer ``num_proc``
        slots (a local master's are known at once).
    verbose : int, default 1
        0 prints nothing by default; 1 shows the ranks' lines; 2 also has each rank report
        its host, pid, device and task attempt first.
    store : Store or str, optional
        A Store or URL holding the run's folder ``runs/<run_id>/``, through which what the
        ranks print or log reaches the driver while they run;
        ``runs/<run_id>/processes/rank-<r>.json`` says where rank r runs (host, pid,
        launch, attempt). By default a fresh temporary folder, removed afterwards, which
        only a local or local-cluster master's executors share: give a multi-host cluster a
        shared ``store``.
    run_id : str, optional
        The name of the run's folder in ``store`` (no ``/``); by default a new one. A
        ``run_id`` with an ``hvd.elastic`` commit resumes from it.
    max_restarts : int, default 3
        A rank lost without an error of its own (a killed process, a lost executor) fails
        the job, unless the ranks had entered ``hvd.elastic.run``: then the job is started
        again, at most ``max_restarts`` times, and resumes from the last ``state.commit()``
        in ``runs/<run_id>/elastic/``.
    min_num_proc : int, optional
        A restarted job starts with as many ranks as the cluster can run then: with
        ``min_num_proc``, any number from ``min_num_proc`` to the largest size (the
        script's reset callbacks see the new size), else at least ``num_proc``.
    elastic_timeout : float, default 600.0
        How many seconds a restart waits for those slots.
    stage_level_scheduling : bool, default True
        On a cluster whose executors have one GPU and whose tasks get less than a whole one
        (a fractional ``spark.task.resource.gpu.amount``, or none), run the job with a task
        resource profile of one GPU and all of an executor's cores per rank (one rank per
        executor, with its GPU; ``num_proc`` then counts GPU slots), where Spark allows it,
        else with the cluster's task resources and one log line saying why (docs/gpu.md).
        False keeps the cluster's task resources.
    max_num_proc : int, optional
        The largest size (Horovod's ``--max-np``); by default ``num_proc``. While a launch
        that entered ``hvd.elastic.run`` runs with fewer ranks (after losing some, or from
        the start) and the cluster offers more slots, the ranks stop at their next
        ``state.commit()`` or ``state.check_host_updates()``, and the job starts again with
        as many ranks as the cluster then runs, up to ``max_num_proc``, from that commit.
        Growing is no restart: it does not count against ``max_restarts``.

    Returns
    -------
    list or object
        The ranks' return values ordered by rank, or only rank 0's with ``rank0_only``;
        None for a script. Return values go through the driver's memory; tensors arrive on
        CPU.

    Raises
    ------
    TypeError, ValueError
        An argument that cannot work (its name first in the message), or a cluster that
        cannot run the job (too few slots for ``num_proc``, no GPU for ``use_gpu=True``),
        before any Spark job.
    FileNotFoundError
        ``fn`` is a path with no script file.
    TrainingError
        A rank's ``fn`` raised (or called ``sys.exit`` with an error): the job fails at
        once, and the error carries that rank, its exception's type, message and traceback,
        and its last lines of output, as a fit's does.
    RuntimeError
        The tasks' Python cannot run a task or import what training needs (checked by one
        tiny job first); an elastic job lost ranks more than ``max_restarts`` times, or the
        cluster did not offer enough slots within ``elastic_timeout``.

    Notes
    -----
    The ranks are numbered host by host, as torchrun numbers them: the ranks of one host
    are consecutive (``local_rank`` counts them), and each host's index is its
    ``GROUP_RANK``, so a Lightning ``Trainer(devices=k, num_nodes=n)`` script takes the
    ranks ``RANK`` says (``TorchElasticEnvironment``) on a job of n hosts of k ranks each.
    Each resize of an elastic job is one log line on the ``spark_estimator.runner`` logger
    (a loss: WARNING; a growth: INFO). A rank lost outside ``hvd.elastic.run`` fails the
    job with Spark's own error.

    Examples
    --------
    >>> from spark_estimator import run
    >>> def train(lr):
    ...     from spark_estimator import distributed as sd
    ...     return sd.allreduce(sd.rank() * lr, average=False)
    >>> run(train, args=(0.1,), num_proc=2)                             # doctest: +SKIP
    [0.1, 0.1]
    >>> run("train.py", args=["--epochs", "5"], num_proc=4)             # doctest: +SKIP
    """
    script = isinstance(fn, (str, os.PathLike))
    if not script and not callable(fn):
        raise TypeError(f"fn: expected a function or a script's path, got {type(fn).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args: expected a tuple or list, got {type(args).__name__}")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(f"kwargs: expected a dict of str keys, got {kwargs!r}")
    if num_proc is not None:
        _check_count("num_proc", num_proc, 1)
    collective_timeout = _check_seconds("collective_timeout", collective_timeout)
    start_timeout = _check_seconds("start_timeout", start_timeout)
    env = _check_env(env)
    _check_stream("stdout", stdout)
    _check_stream("stderr", stderr)
    verbose = _check_count("verbose", verbose, 0)
    max_restarts = _check_count("max_restarts", max_restarts, 0)
    if min_num_proc is not None:
        _check_count("min_num_proc", min_num_proc, 1)
    if max_num_proc is not None:
        _check_count("max_num_proc", max_num_proc, 1)
        if num_proc is not None and max_num_proc < num_proc:
            raise ValueError(
                f"max_num_proc: {max_num_proc} is less than num_proc={num_proc}; a run starts "
                "with num_proc ranks and grows to at most max_num_proc"
            )
        if min_num_proc is not None and min_num_proc > max_num_proc:
            raise ValueError(
                f"min_num_proc: {min_num_proc} is more than max_num_proc={max_num_proc}"
            )
    elastic_timeout = _check_seconds("elastic_timeout", elastic_timeout)
    if not isinstance(stage_level_scheduling, bool):
        raise TypeError(
            f"stage_level_scheduling: expected True or False, got {stage_level_scheduling!r}"
        )
    if run_id is not None and (not isinstance(run_id, str) or not run_id or "/" in run_id):
        raise ValueError(f"run_id: expected a folder name (no '/'), got {run_id!r}")
    if script:
        shipped, payload = _read_script(fn, args, kwargs), None
        name = os.path.basename(shipped.path)
    else:
        shipped, payload = None, _payload(fn, tuple(args), dict(kwargs))
        name = getattr(fn, "__qualname__", type(fn).__name__)
    if store is not None and not isinstance(store, (str, Store)):
        raise TypeError(f"store: expected a Store or a URL, got {type(store).__name__}")
    use_gpu = to_use_gpu(use_gpu)
    spark = spark if spark is not None else SparkSession.active()
    if script and not _tasks_see_this_machine(spark):
        shipped = dataclasses.replace(shipped, modules=_modules_beside(shipped.file))
    stage = task_profile(spark, stage_level_scheduling, use_gpu)
    use_gpu = check_use_gpu(spark, use_gpu, stage)
    slots = available_slots(spark, num_proc, start_timeout, stage.profile)
    check_task_python(spark)
    if num_proc is None:
        num_proc = slots if max_num_proc is None else min(slots, max_num_proc)
    slots_of = stage.slots_note()
    if min_num_proc is None:
        check_num_proc(num_proc, slots, f"start_timeout={start_timeout:g} s", slots_of=slots_of)
    size = ElasticSize(
        spark,
        num_proc if max_num_proc is None else max_num_proc,
        num_proc if min_num_proc is None else min_num_proc,
        check_min_num_proc(min_num_proc, num_proc, slots, slots_of),
        max_restarts,
        elastic_timeout,
        stage.profile,
    )

    run_id = run_id or f"run-{uuid.uuid4().hex[:12]}"
    show = _shower(stdout, stderr, verbose)
    store, temporary = _run_store(store)  # a default one is removed in the finally below
    try:
        while True:
            if store.exists(store.run(run_id).grow):  # a request of an earlier launch
                store.remove(store.run(run_id).grow)
            spec = RunSpec(
                payload,
                shipped,
                env,
                use_gpu,
                bool(rank0_only),
                collective_timeout,
                store,
                run_id,
                uuid.uuid4().hex,
                verbose,
                not tasks_print_here(spark),
            )
            try:
                summaries = _launch(spark, spec, size, name, show, stage.profile)
            except _LostRank as lost:
                size.after_loss(lost.__cause__)
                log.warning(
                    "run '%s': ranks were lost (%s); starting the job again with %d ranks "
                    "from the last hvd.elastic commit (restart %d of at most %d)",
                    run_id,
                    lost_reason(lost.__cause__),
                    size.procs,
                    size.restarts,
                    max_restarts,
                )
                continue
            if not any(s["paused"] for s in summaries):
                break
            before = size.procs
            size.after_growth_request(None)
            log.info(
                "run '%s': the cluster offers more task slots; starting the job again with "
                "%d ranks (was %d) from the last hvd.elastic commit (a growth, not a restart)",
                run_id,
                size.procs,
                before,
            )
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    notes: dict[str, list[int]] = {}
    for s in summaries:
        if s["device_note"]:
            notes.setdefault(s["device_note"], []).append(s["rank"])
    if notes:
        warnings.warn(
            "; ".join(f"ranks {ranks}: {note}" for note, ranks in notes.items()),
            RuntimeWarning,
            stacklevel=2,
        )
    if script:
        return None
    if rank0_only:
        return _decode_result(summaries[0]["result"])
    return [_decode_result(s["result"]) for s in summaries]


def _launch(spark, spec: RunSpec, size: ElasticSize, name: str, show, profile=None) -> list[dict]:
    """One launch of the job, of ``size.procs`` ranks, with the task resource ``profile``
    of stage-level scheduling (None: the cluster's task resources), its ranks' lines shown
    as they arrive; once it entered ``hvd.elastic.run``, it is asked to grow when the
    cluster offers more slots (``request_growth``). Raises a ``TrainingError`` for an error
    of the training code, ``_LostRank`` (from Spark's error) for another failure of a
    launch that entered ``hvd.elastic.run``."""
    store, run = spec.store, spec.store.run(spec.run_id)
    tag = f"spark-estimator-{spec.launch_id}"
    cancel = functools.partial(cancel_jobs, spark, tag)

    def watch() -> None:
        if store.exists(run.elastic_launch(spec.launch_id)):
            request_growth(store, run, size)

    monitor = FitMonitor(
        store, spec.run_id, spec.launch_id, False, show=show, cancel=cancel, watch=watch
    )
    num_proc = size.procs
    try:
        with monitor:
            return run_barrier_job(
                spark,
                num_proc,
                functools.partial(run_task, spec),
                f"spark-estimator run {name} on {num_proc} tasks",
                tag=tag,
                profile=profile,
            )
    except Exception as e:
        record = read_failure(run.failure(spec.launch_id), store)
        if record is None and store.exists(run.elastic_launch(spec.launch_id)):
            raise _LostRank() from e
        record = record or carried_failure(e)
        if record is None:
            raise
        output = monitor.tail(record["rank"]) or rank_lines(
            record["rank"], record.get("output", [])
        )
        error = TrainingError(spec.run_id, record, output)
        error.spark_error = e  # not chained: its traceback repeats the error's
        raise error from None
