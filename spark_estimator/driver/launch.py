"""Driver: count task slots and run the one barrier-mode job of a fit.

The job is built with the DataFrame API (``mapInPandas(..., barrier=True)`` over a range of
``num_proc`` single-row partitions), which also runs on Spark Connect. Each task returns one
row, a JSON summary of its rank; large results go through the store, not through rows.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable

from pyspark.sql import SparkSession

_LOCAL = re.compile(r"local\[(\*|\d+)(?:,\s*\d+)?\]")
_LOCAL_CLUSTER = re.compile(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]")


def available_slots(spark: SparkSession) -> int:
    """How many tasks the cluster can run at once (cores / ``spark.task.cpus``)."""
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


def run_barrier_job(
    spark: SparkSession, num_proc: int, task: Callable[[], dict], description: str
) -> list[dict]:
    """Run ``task`` on ``num_proc`` barrier tasks at once; return their summaries by rank."""

    def job(batches):  # runs on the executors
        import pandas as pd

        for _ in batches:  # the single input row carries nothing
            pass
        summary = task()
        yield pd.DataFrame({"summary": [json.dumps(summary)]})

    spark.sparkContext.setJobDescription(description)
    try:
        rows = (
            spark.range(num_proc, numPartitions=num_proc)
            .mapInPandas(job, "summary string", barrier=True)
            .collect()
        )
    finally:
        spark.sparkContext.setJobDescription(None)
    return sorted((json.loads(r.summary) for r in rows), key=lambda s: s["rank"])
