"""Executor: the function of every barrier job's tasks (``driver/launch.py`` runs it with
``mapInPandas(..., barrier=True)``): it runs one task's function and returns its summary as
the task's one row of JSON."""

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
