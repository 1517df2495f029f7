"""Driver: count task slots and run the one barrier-mode job of a fit.

The job is built with the DataFrame API (``mapInPandas(..., barrier=True)`` over a range of
``num_proc`` single-row partitions), so it runs on a classic session and on Spark Connect
alike. Each task returns one row, a JSON summary of its rank; large results go through the
store, not through rows.

Spark does not retry a failed barrier stage whose output is the job's result: after a lost
task the whole job fails, and the driver decides whether to start it again
(``ElasticSize``).

On Spark Connect there is no SparkContext on this side: slots are counted from the
server's configuration alone (see ``connect_slots``), and the job is labelled with a job
tag (``spark.addTag``) instead of a job description.

A job may run with a task resource ``profile`` (stage-level scheduling,
``task_profile``): its slots are then counted under it (the profile's cpus per
task), and the job is ``mapInPandas(..., profile=...)``, or on pyspark 3.5, which has no
such argument, the same tasks as an RDD ``withResources(profile)``.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pyspark.sql import DataFrame, SparkSession

from ..worker.job import barrier_job, barrier_rdd_job

_LOCAL = re.compile(r"local\[(\*|\d+)(?:,\s*\d+)?\]")
_LOCAL_CLUSTER = re.compile(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]")
SLOT_WAIT_S = 30.0  # how long to wait for executors to register before counting slots
# Spark's loggers that repeat a failed training job's error at length while it runs: each
# failed or killed barrier task's Python traceback and Java stack (the executor's "Exception
# in task", the scheduler's "Lost task"). The driver raises the error once itself (a
# TrainingError, or Spark's own error), so they are off while the job runs.
QUIET_LOGGERS = (
    "org.apache.spark.executor.Executor",
    "org.apache.spark.scheduler.TaskSetManager",
    "org.apache.spark.sql.execution.python",
    "org.apache.spark.api.python",
)
TASKS_END_S = 30.0  # how long a failed job's other tasks may take to end (wait_for_job_tasks)
QUIET_AFTER_FAILURE_S = 10.0  # they stay off this long after a failed job: its killed tasks
log = logging.getLogger(__name__)


def is_connect(spark) -> bool:
    """Whether ``spark`` is a Spark Connect session (no JVM on this side)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def _local_cores(master: str) -> int | None:
    """Cores a local master URL names; None for a cluster manager's URL."""
    if master == "local":
        return 1
    if m := _LOCAL.fullmatch(master):
        return (os.cpu_count() or 1) if m.group(1) == "*" else int(m.group(1))
    if m := _LOCAL_CLUSTER.fullmatch(master):
        return int(m.group(1)) * int(m.group(2))
    return None


def is_local_master(master: str) -> bool:
    """Whether ``master`` runs every task in the driver's JVM (``local``, ``local[N]``; not
    ``local-cluster``, whose executors are processes of their own)."""
    return master == "local" or bool(_LOCAL.fullmatch(master))


def takes_profile() -> bool:
    """Whether DataFrames take a task resource profile in ``mapInPandas`` and
    ``mapInArrow`` (pyspark 4, classic and Connect alike)."""
    return "profile" in inspect.signature(DataFrame.mapInPandas).parameters


def profile_cpus(profile) -> int | None:
    """The cpus per task of a task resource ``profile`` (None: no profile, or none said)."""
    if profile is None:
        return None
    cpus = profile.taskResources.get("cpus")
    return None if cpus is None else int(cpus.amount)


def tasks_print_here(spark: SparkSession) -> bool:
    """Whether the tasks' own stdout and stderr are this driver's (a ``local`` master: the
    executor is the driver's JVM); not so on Spark Connect or any cluster."""
    if is_connect(spark):
        return False
    master = spark.sparkContext.master
    return master == "local" or master.startswith("local[")


def master_slots(spark: SparkSession, profile=None) -> int:
    """Task slots implied by the master URL and ``spark.task.cpus`` (cores / task cpus), or
    the cpus per task of a task resource ``profile``."""
    if is_connect(spark):
        slots = connect_slots(spark, profile)
        return 0 if slots is None else slots
    sc = spark.sparkContext
    task_cpus = profile_cpus(profile) or int(sc.getConf().get("spark.task.cpus", "1"))
    cores = _local_cores(sc.master)
    return max(0, (sc.defaultParallelism if cores is None else cores) // task_cpus)


def connect_slots(spark: SparkSession, profile=None) -> int | None:
    """Slots of a Spark Connect server, from its configuration: the cores of a local master
    URL (``local[*]``: this machine's), else ``spark.default.parallelism``, else
    ``spark.executor.instances`` x ``spark.executor.cores``; each divided by
    ``spark.task.cpus`` (or a task resource ``profile``'s cpus per task). None where the
    configuration does not say (executors that come and go, a cluster manager's defaults)."""

    def conf(key: str) -> str | None:
        value = spark.conf.get(key, None)
        return None if value in (None, "") else value

    task_cpus = profile_cpus(profile) or int(conf("spark.task.cpus") or 1)
    cores = _local_cores(conf("spark.master") or "")
    if cores is None and conf("spark.default.parallelism"):
        cores = int(conf("spark.default.parallelism"))
    if cores is None and conf("spark.executor.instances") and conf("spark.executor.cores"):
        cores = int(conf("spark.executor.instances")) * int(conf("spark.executor.cores"))
    return None if cores is None else max(0, cores // task_cpus)


def scheduler_slots(spark: SparkSession, profile=None) -> int | None:
    """The scheduler's own count of tasks that can run at once on the executors registered
    now: the count Spark checks barrier stages against, so it also knows task resources such
    as ``spark.task.resource.gpu.amount``; under a task resource ``profile`` (registered
    with Spark: ``stage_profile``), the tasks of that profile. None where it cannot be asked
    (Spark Connect)."""
    if is_connect(spark):
        return None
    try:
        sc = spark.sparkContext._jsc.sc()
        if profile is None:
            profile_in_jvm = sc.resourceProfileManager().defaultResourceProfile()
        else:
            profile_in_jvm = profile._java_resource_profile
        return int(sc.maxNumConcurrentTasks(profile_in_jvm))
    except Exception:
        return None


def available_slots(
    spark: SparkSession, wanted: int | None = None, wait_s: float | None = None, profile=None
) -> int:
    """How many tasks the cluster can run at once (of a task resource ``profile``'s, when
    given).

    Executors of a cluster register after the session starts, so while the scheduler
    counts fewer than ``wanted`` (or than the master URL implies) it is asked again, for
    at most ``wait_s`` seconds (``SLOT_WAIT_S`` when None). In local mode the count is
    known at once.

    On Spark Connect the count comes from the server's configuration (``connect_slots``);
    where that does not tell, ``wanted`` is trusted (Spark itself refuses a barrier stage
    larger than the cluster) and, without it, ``num_proc`` is required.
    """
    if is_connect(spark):
        slots = connect_slots(spark, profile)
        if slots is not None:
            return slots
        if wanted is None:
            raise ValueError(
                "num_proc: the task slots of this Spark Connect session cannot be counted "
                f"(master {spark.conf.get('spark.master', None)!r} without "
                "spark.default.parallelism, or spark.executor.instances and "
                "spark.executor.cores, in the server's configuration); set num_proc to the "
                "number of training processes"
            )
        return wanted
    expected = master_slots(spark, profile)
    master = spark.sparkContext.master
    local = master.startswith("local") and not master.startswith("local-cluster")
    wait_s = SLOT_WAIT_S if wait_s is None else wait_s
    deadline = time.monotonic() + (0 if local else wait_s)
    while True:
        counted = scheduler_slots(spark, profile)
        if counted is None:
            return expected
        if counted >= (wanted or expected) or time.monotonic() >= deadline:
            return counted
        time.sleep(0.25)


def job_tag(description: str) -> str:
    """``description`` as a Spark Connect job tag (which may not contain commas)."""
    return description.replace(",", ";") or "spark-estimator"


@contextmanager
def labelled_jobs(spark: SparkSession, description: str, tag: str | None = None) -> Iterator[None]:
    """Label the jobs this thread starts inside the block: the job description of a
    classic session, a job tag on Spark Connect (``spark.interruptTag`` can cancel it).
    With ``tag`` the jobs also carry that tag on a classic session, and on Spark Connect it
    is the tag: ``cancel_jobs(spark, tag)`` cancels them from any thread."""
    if is_connect(spark):
        tag = job_tag(tag or description)
        spark.addTag(tag)
        try:
            yield
        finally:
            spark.removeTag(tag)
        return
    sc = spark.sparkContext
    sc.setJobDescription(description)
    if tag:
        sc.addJobTag(tag)
    try:
        yield
    finally:
        sc.setJobDescription(None)
        if tag:
            sc.removeJobTag(tag)


def cancel_jobs(spark: SparkSession, tag: str) -> None:
    """Cancel the running jobs labelled with ``tag`` (see ``labelled_jobs``); their tasks
    are killed, and the thread waiting for a job's result gets Spark's error."""
    if is_connect(spark):
        spark.interruptTag(job_tag(tag))
    else:
        spark.sparkContext.cancelJobsWithTag(tag)


def wait_for_job_tasks(spark: SparkSession, tag: str, timeout_s: float = TASKS_END_S) -> bool:
    """Wait until no task of the jobs labelled ``tag`` runs any more (at most
    ``timeout_s``); whether none does. A failed job's other tasks end only after it has
    failed (Spark kills them, a rank may raise a few seconds later): a fit that raised at
    once would let ``spark.stop()`` tear down the blocks those tasks still hold, and their
    completion would print a Java stack trace (``Block broadcast_N does not exist``). On
    Spark Connect, whose scheduler is not reachable from here, it does not wait."""
    if is_connect(spark):
        return True
    deadline = time.monotonic() + timeout_s
    try:
        tracker = spark.sparkContext._jsc.sc().statusTracker()
        while True:
            active = 0
            for job in tracker.getJobIdsForTag(tag):
                info = tracker.getJobInfo(job)
                stages = info.get().stageIds() if info.isDefined() else []
                for stage in stages:
                    found = tracker.getStageInfo(stage)
                    active += found.get().numActiveTasks() if found.isDefined() else 0
            if active == 0:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)
    except Exception as e:  # a JVM without the status tracker's tags: nothing to wait on
        log.debug("could not follow the tasks of jobs %s: %s", tag, e)
        return True


def run_barrier_job(
    spark: SparkSession,
    num_proc: int,
    task: Callable[[], dict],
    description: str,
    tag: str | None = None,
    profile=None,
) -> list[dict]:
    """Run ``task`` on ``num_proc`` barrier tasks at once; return their summaries by rank.
    With ``tag``, ``cancel_jobs(spark, tag)`` cancels the job; with ``profile`` (a pyspark
    ResourceProfile, ``stage_profile``) its tasks get the profile's resources. Spark's log
    lines of its failed tasks are silenced while it runs (``quiet_task_errors``)."""
    with labelled_jobs(spark, description, tag), quiet_task_errors(spark):
        if profile is not None and not takes_profile():  # pyspark 3.5: an RDD's stage
            rdd = spark.sparkContext.parallelize(range(num_proc), num_proc).barrier()
            texts = rdd.mapPartitions(barrier_rdd_job(task)).withResources(profile).collect()
        else:
            with_profile = {} if profile is None else {"profile": profile}
            summaries = spark.range(num_proc, numPartitions=num_proc).mapInPandas(
                barrier_job(task), "summary string", barrier=True, **with_profile
            )
            texts = [r.summary for r in summaries.collect()]
    return sorted((json.loads(text) for text in texts), key=lambda s: s["rank"])


class _Quiet:
    """The silenced loggers' own levels (None: no level of their own) while any training
    job of this process runs, or a failed one's tasks may still be ending; jobs of several
    threads (a CrossValidator's) share it."""

    lock = threading.Lock()
    jobs = 0
    saved: dict[str, object] | None = None
    timer: threading.Timer | None = None


@contextmanager
def quiet_task_errors(spark: SparkSession) -> Iterator[None]:
    """Turn ``QUIET_LOGGERS`` off in this driver's JVM (log4j 2) while the block runs, and
    back to their own levels after the last block of the process ends; after a failed job
    only ``QUIET_AFTER_FAILURE_S`` later, as Spark kills its other tasks (and logs that)
    after the job has failed.

    The scheduler runs in the driver's JVM on every master, so the "Lost task" lines are
    gone everywhere; the executors' "Exception in task" lines are gone where the executor
    is this JVM (a ``local`` master) and stay in the executors' own logs on a cluster. On
    Spark Connect the server's JVM is not reachable from here: nothing changes. Other
    jobs running at the same time in this JVM lose those lines too."""
    if is_connect(spark):
        yield
        return
    with _Quiet.lock:
        if _Quiet.timer is not None:
            _Quiet.timer.cancel()
            _Quiet.timer = None
        if _Quiet.jobs == 0 and _Quiet.saved is None:
            _Quiet.saved = _set_levels(spark, None)
        _Quiet.jobs += 1
    failed = True
    try:
        yield
        failed = False
    finally:
        with _Quiet.lock:
            _Quiet.jobs -= 1
            if _Quiet.jobs == 0 and _Quiet.saved is not None:
                if failed:
                    _Quiet.timer = threading.Timer(QUIET_AFTER_FAILURE_S, _restore, [spark])
                    _Quiet.timer.daemon = True
                    _Quiet.timer.start()
                else:
                    _restore(spark, locked=True)


def _restore(spark: SparkSession, locked: bool = False) -> None:
    """The silenced loggers' own levels again, unless a training job runs."""
    with contextlib.nullcontext() if locked else _Quiet.lock:
        if _Quiet.jobs == 0 and _Quiet.saved is not None:
            _set_levels(spark, _Quiet.saved)
            _Quiet.saved, _Quiet.timer = None, None


def _set_levels(spark: SparkSession, levels: dict | None) -> dict | None:
    """Give ``QUIET_LOGGERS`` ``levels`` (a level object, or None for none of their own);
    all OFF when ``levels`` is None. Returns the levels they had (None where this JVM's
    logging is not log4j 2, when nothing changes)."""
    try:
        jvm = spark.sparkContext._jvm
        log4j = jvm.org.apache.logging.log4j
        context = log4j.LogManager.getContext(False)
        config = context.getConfiguration()
        own = config.getLoggers()  # name -> LoggerConfig, those with settings of their own
        before = {}
        for name in QUIET_LOGGERS:
            before[name] = own.get(name).getLevel() if own.containsKey(name) else None
            level = log4j.Level.OFF if levels is None else levels[name]
            if level is not None:
                log4j.core.config.Configurator.setLevel(name, level)
            elif own.containsKey(name):
                config.removeLogger(name)  # back to its parent's level, as before
        context.updateLoggers()
        return before
    except Exception as e:  # another logging backend: Spark's lines stay
        log.debug("could not set the levels of Spark's task loggers: %s", e)
        return None
