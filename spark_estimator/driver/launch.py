"""Driver: count task slots and run the one barrier-mode job of a fit.

The job is built with the DataFrame API (``mapInPandas(..., barrier=True)`` over a range of
``num_proc`` single-row partitions), which also runs on Spark Connect. Each task returns one
row, a JSON summary of its rank; large results go through the store, not through rows.

Spark does not retry a failed barrier stage whose output is the job's result, but it does
retry a barrier stage that feeds a shuffle (up to ``spark.stage.maxConsecutiveAttempts``
times, 4 by default), relaunching all of its tasks. ``retry=True`` adds that shuffle (of
``num_proc`` small rows) so that a fit survives a lost process or executor.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable

from pyspark.sql import SparkSession

_LOCAL = re.compile(r"local\[(\*|\d+)(?:,\s*\d+)?\]")
_LOCAL_CLUSTER = re.compile(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]")
SLOT_WAIT_S = 30.0  # how long to wait for executors to register before counting slots


def master_slots(spark: SparkSession) -> int:
    """Task slots implied by the master URL and ``spark.task.cpus`` (cores / task cpus)."""
    sc = spark.sparkContext
    master = sc.master
    task_cpus = int(sc.getConf().get("spark.task.cpus", "1"))
    if master == "local":
        cores = 1
    elif m := _LOCAL.fullmatch(master):
        cores = (os.cpu_count() or 1) if m.group(1) == "*" else int(m.group(1))
    elif m := _LOCAL_CLUSTER.fullmatch(master):
        cores = int(m.group(1)) * int(m.group(2))
    else:
        cores = sc.defaultParallelism
    return max(0, cores // task_cpus)


def scheduler_slots(spark: SparkSession) -> int | None:
    """The scheduler's own count of tasks that can run at once on the executors registered
    now: the count Spark checks barrier stages against, so it also knows task resources such
    as ``spark.task.resource.gpu.amount``. None where it cannot be asked (Spark Connect)."""
    try:
        sc = spark.sparkContext._jsc.sc()
        return int(sc.maxNumConcurrentTasks(sc.resourceProfileManager().defaultResourceProfile()))
    except Exception:
        return None


def available_slots(spark: SparkSession, wanted: int | None = None) -> int:
    """How many tasks the cluster can run at once.

    Executors of a cluster register after the session starts, so while the scheduler
    counts fewer than ``wanted`` (or than the master URL implies) it is asked again, for
    at most ``SLOT_WAIT_S`` seconds. In local mode the count is known at once.
    """
    expected = master_slots(spark)
    master = spark.sparkContext.master
    local = master.startswith("local") and not master.startswith("local-cluster")
    deadline = time.monotonic() + (0 if local else SLOT_WAIT_S)
    while True:
        counted = scheduler_slots(spark)
        if counted is None:
            return expected
        if counted >= (wanted or expected) or time.monotonic() >= deadline:
            return counted
        time.sleep(0.25)


def run_barrier_job(
    spark: SparkSession,
    num_proc: int,
    task: Callable[[], dict],
    description: str,
    retry: bool = False,
) -> list[dict]:
    """Run ``task`` on ``num_proc`` barrier tasks at once; return their summaries by rank.
    With ``retry``, Spark relaunches all tasks when one fails (see above)."""

    def job(batches):  # runs on the executors
        import pandas as pd

        for _ in batches:  # the single input row carries nothing
            pass
        summary = task()
        yield pd.DataFrame({"summary": [json.dumps(summary)]})

    spark.sparkContext.setJobDescription(description)
    try:
        summaries = spark.range(num_proc, numPartitions=num_proc).mapInPandas(
            job, "summary string", barrier=True
        )
        rows = (summaries.repartition(1) if retry else summaries).collect()
    finally:
        spark.sparkContext.setJobDescription(None)
    return sorted((json.loads(r.summary) for r in rows), key=lambda s: s["rank"])
