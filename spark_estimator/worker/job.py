"""Executor: the function of every barrier job's tasks (``run_barrier_job`` runs it with
``mapInPandas(..., barrier=True)``, or as an RDD's where pyspark 3.5 gives a task resource
profile only to RDDs): it runs one task's function and returns its summary as the task's
one row of JSON."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator


def barrier_job(task: Callable[[], dict]) -> Callable[[Iterator], Iterator]:
    """The ``mapInPandas`` function of a job whose every task runs ``task``."""

    def job(batches):
        import pandas as pd

        for _ in batches:  # the single input row carries nothing
            pass
        summary = task()
        yield pd.DataFrame({"summary": [json.dumps(summary)]})

    return job


def barrier_rdd_job(task: Callable[[], dict]) -> Callable[[Iterator], Iterator[str]]:
    """The same for ``RDD.barrier().mapPartitions``: the summary as one string."""

    def job(partition):
        for _ in partition:  # the single element carries nothing
            pass
        yield json.dumps(task())

    return job
