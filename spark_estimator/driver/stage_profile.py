"""Driver: stage-level scheduling, the task resources of the training job and of transform.

On a GPU cluster users give tasks a fraction of a GPU (``spark.task.resource.gpu.amount``
= 1 / ``spark.executor.cores``) so that ETL runs a task per core; a training task would then
share its executor's GPU with the executor's other tasks, or get none where the amount is
unset. So the training barrier job alone (and transform's tasks) runs with a task resource
profile of one GPU and all of an executor's cores: one task per executor, each with the
executor's GPU to itself, while every other job keeps the cluster's settings. The cores
make it one task per executor: the GPU amount of a task profile does not limit how many
run at once (SPARK-45527).

Spark offers such profiles (``TaskResourceProfile``, no new executors) from 3.4 on
standalone and local-cluster masters, from 3.5.1 also on YARN and Kubernetes, never on a
local master, and only with dynamic allocation off. The profile needs
``spark.executor.cores`` (an executor's cores, asked for whole) and executors of one GPU
(``spark.executor.resource.gpu.amount`` 1: with more, one task per executor would leave
the others idle; a whole GPU per task, ``spark.task.resource.gpu.amount=1``, is the way
there). ``decide`` says whether it applies, from those facts alone; ``task_profile`` reads
them from a session, builds the profile (``mapInPandas``/``mapInArrow(profile=...)`` on
pyspark 4, classic and Connect; the barrier job as an RDD ``withResources`` on pyspark 3.5)
and, where the cluster has GPUs but the profile does not apply, logs why once per session.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .launch import is_connect, is_local_master, takes_profile

log = logging.getLogger(__name__)
_logged: set[tuple[str, str]] = set()  # (session, line) already logged
_built: dict[tuple[str, int], Any] = {}  # (session, cpus) -> its profile, made once


@dataclass(frozen=True)
class ClusterFacts:
    """What decides whether a task resource profile applies, read from a session."""

    version: str  # Spark's (the server's on Spark Connect)
    master: str
    local: bool  # a local master: the driver's JVM runs every task
    connect: bool
    takes_profile: bool  # DataFrame.mapInPandas / mapInArrow take profile= (pyspark >= 4)
    executor_gpus: float  # spark.executor.resource.gpu.amount (0: no GPUs configured)
    task_gpus: float  # spark.task.resource.gpu.amount (0: unset)
    executor_cores: int | None  # spark.executor.cores (None: unset)
    task_cpus: int  # spark.task.cpus
    dynamic_allocation: bool


@dataclass(frozen=True)
class TaskProfile:
    """The task resources of a job: ``profile`` (a pyspark ResourceProfile) or None for the
    cluster's own; each task's ``cpus`` and ``gpus`` under them; and, where the cluster has
    GPUs but gets no profile, ``reason``."""

    profile: Any
    cpus: int
    gpus: float
    reason: str | None

    def summary(self) -> dict:
        """For a training summary: whether the job ran with the profile, each task's
        resources, and why not."""
        return {
            "stage_level_scheduling": self.profile is not None,
            "task_cpus": self.cpus,
            "task_gpus": self.gpus,
            "reason": self.reason,
        }

    def slots_note(self) -> str | None:
        """What a slot is under the profile, for num_proc's error (None without one)."""
        if self.profile is None:
            return None
        return (
            "under stage-level scheduling each training process takes an executor's GPU and "
            f"all its {self.cpus} cores (stage_level_scheduling=True), so an executor with a "
            "GPU runs one"
        )


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _cluster_manager_reason(cluster: ClusterFacts) -> str | None:
    """Why this Spark and master offer no task resource profiles (None: they do)."""
    version, master = _version(cluster.version), cluster.master
    if cluster.local:
        return (
            f"the master {master!r} is a local master: the driver's JVM runs every task, and "
            "task resource profiles need a cluster (standalone, local-cluster, YARN, Kubernetes)"
        )
    if version < (3, 4):
        return (
            f"Spark {cluster.version} has no task resource profiles for a cluster of fixed "
            "executors (Spark 3.4 or later)"
        )
    if master.startswith(("spark://", "local-cluster")):
        return None
    if master == "yarn" or master.startswith("k8s://"):
        if version < (3, 5, 1):
            return (
                f"Spark {cluster.version} offers task resource profiles on YARN and "
                "Kubernetes from Spark 3.5.1 (standalone and local-cluster from 3.4)"
            )
        return None
    return (
        f"the master {master!r}: task resource profiles need a standalone, local-cluster, "
        "YARN or Kubernetes master"
    )


def _shape_reason(cluster: ClusterFacts, job: str) -> str | None:
    """Why this session or these executors cannot take the profile (None: they can)."""
    if not cluster.takes_profile and (cluster.connect or job == "transform"):
        what = "Spark Connect's barrier job" if cluster.connect else "transform's mapInArrow"
        return f"{what} takes a task resource profile from pyspark 4.0 on"
    if cluster.dynamic_allocation:
        return "spark.dynamicAllocation.enabled=true: the profile needs a fixed set of executors"
    if cluster.executor_gpus > 1:
        gpus = f"{cluster.executor_gpus:g}"
        return (
            f"executors have {gpus} GPUs (spark.executor.resource.gpu.amount={gpus}): one "
            "task of all an executor's cores would leave the others idle; give every task a "
            "whole GPU instead, spark.task.resource.gpu.amount=1 with spark.task.cpus = the "
            "executor's cores per GPU (docs/gpu.md)"
        )
    if cluster.executor_cores is None:
        return (
            "spark.executor.cores is not set: the profile asks for all of an executor's "
            "cores, so Spark must be told how many it has"
        )
    if cluster.executor_cores <= 1:
        if cluster.task_gpus > 0:
            return (
                "spark.executor.cores=1: an executor runs one task at a time, which already "
                "gets its executor's GPU"
            )
        return (
            "spark.executor.cores=1: an executor runs one task at a time, so set "
            "spark.task.resource.gpu.amount=1 to give each task its executor's GPU"
        )
    return None


def decide(
    cluster: ClusterFacts, enabled: bool, use_gpu: bool | str, job: str
) -> tuple[int | None, str | None]:
    """(the cpus of each task under a profile of one GPU, or None for the cluster's own
    task resources; why not, where the cluster has GPUs configured). ``job`` is
    "training" (a barrier job) or "transform"."""
    if cluster.executor_gpus <= 0:
        return None, None  # no GPUs: nothing to give, nothing to say
    if not enabled:
        return None, "switched off by stage_level_scheduling=False"
    if use_gpu is False:
        return None, "use_gpu=False: the training tasks run on the CPU"
    if cluster.task_gpus >= 1:
        amount = f"{cluster.task_gpus:g}"
        return None, f"each task already gets a whole GPU (spark.task.resource.gpu.amount={amount})"
    reason = _cluster_manager_reason(cluster) or _shape_reason(cluster, job)
    return (None, reason) if reason else (cluster.executor_cores, None)


def _conf(spark, key: str) -> str | None:
    try:
        value = spark.conf.get(key, None)
    except Exception:  # a session that cannot tell
        return None
    return None if value in (None, "") else value


def _number(text: str | None) -> float:
    try:
        return float(text or 0)
    except ValueError:
        return 0.0


def cluster_facts(spark) -> ClusterFacts:
    """The facts ``decide`` needs, from ``spark``'s settings (the server's on Connect)."""
    connect = is_connect(spark)
    if connect:
        master = _conf(spark, "spark.master") or ""
        local = is_local_master(master)
    else:
        master = spark.sparkContext.master
        local = bool(spark.sparkContext._jsc.sc().isLocal())
    cores = _conf(spark, "spark.executor.cores")
    return ClusterFacts(
        version=spark.version,
        master=master,
        local=local,
        connect=connect,
        takes_profile=takes_profile(),
        executor_gpus=_number(_conf(spark, "spark.executor.resource.gpu.amount")),
        task_gpus=_number(_conf(spark, "spark.task.resource.gpu.amount")),
        executor_cores=int(cores) if cores and cores.isdigit() else None,
        task_cpus=int(_number(_conf(spark, "spark.task.cpus")) or 1),
        dynamic_allocation=str(_conf(spark, "spark.dynamicAllocation.enabled")).lower() == "true",
    )


def _build(spark, cpus: int):
    """The profile of one GPU and ``cpus`` cores per task, registered with Spark (which
    refuses one its cluster manager cannot run, here rather than at the job)."""
    from pyspark.resource import ResourceProfile, ResourceProfileBuilder, TaskResourceRequests

    requests = TaskResourceRequests().cpus(cpus).resource("gpu", 1.0)
    if is_connect(spark):
        profile = ResourceProfile(_exec_req={}, _task_req=requests.requests)
        profile.id  # noqa: B018 -- made on the server now
        return profile
    profile = ResourceProfileBuilder().require(requests).build
    manager = spark.sparkContext._jsc.sc().resourceProfileManager()
    manager.addResourceProfile(profile._java_resource_profile)
    return profile


def _session_key(spark) -> str:
    if is_connect(spark):
        return str(getattr(spark, "session_id", id(spark)))
    return spark.sparkContext.applicationId


def _log_once(spark, line: str) -> None:
    key = (_session_key(spark), line)
    if key not in _logged:
        _logged.add(key)
        log.info(line)


def task_profile(spark, enabled: bool, use_gpu: bool | str = "auto", job: str = "training"):
    """The task resources ``job`` ("training" or "transform") runs with on ``spark``: a
    profile of one GPU and an executor's cores where ``decide`` says so and Spark takes it;
    else the cluster's own, with the reason logged once per session where it has GPUs."""
    cluster = cluster_facts(spark)
    cpus, reason = decide(cluster, enabled, use_gpu, job)
    if cpus is not None:
        key = (_session_key(spark), cpus)
        try:
            profile = _built.get(key) or _build(spark, cpus)
        except Exception as e:  # Spark refused it: its reason, first line
            reason = f"Spark refused the task resource profile: {str(e).strip().splitlines()[0]}"
        else:
            _built[key] = profile  # one profile (and id) for every job of the session
            _log_once(
                spark,
                f"stage-level scheduling: {job} tasks run with one GPU and {cpus} cores each "
                "(one per executor)",
            )
            return TaskProfile(profile, cpus, 1.0, None)
    if reason:
        _log_once(spark, f"stage-level scheduling does not apply to {job} here: {reason}")
    return TaskProfile(None, cluster.task_cpus, cluster.task_gpus, reason)
