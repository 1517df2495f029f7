"""Driver: a fit's training job, launched until it ends: started again after lost
processes (resized when the fit is elastic, ``ElasticSize``) or to grow when slots return;
the training code's own error raised at once as a TrainingError with the failing rank's
last lines. The ranks' output and progress reach the driver through ``FitMonitor``."""

from __future__ import annotations

import functools
import logging
from dataclasses import replace

from pyspark.sql import SparkSession

from ..shared.failures import TrainingError, read_failure
from ..shared.spec import TrainSpec, launch_secret
from ..shared.summary import RankSummary
from ..worker.task import training_task
from .elastic import ElasticSize, lost_reason, request_growth
from .launch import cancel_jobs, run_barrier_job, wait_for_job_tasks
from .monitor import FitMonitor

logger = logging.getLogger(__name__)


class LostProcesses(Exception):
    """A launch of the training job failed without an error of the training code."""


def run_training_job(
    spark: SparkSession, spec: TrainSpec, size: ElasticSize, verbose: bool, profile=None
) -> tuple[list[RankSummary], list[dict]]:
    """Run the training job with ``size``'s processes, starting it again after lost
    processes and when the ranks paused for the job to grow; the ranks' summaries and the
    resizes. ``profile``: the task resource profile of stage-level scheduling (None: the
    cluster's task resources)."""
    store, run = spec.store, spec.store.run(spec.run_id)
    monitor = FitMonitor(store, spec.run_id, spec.launch_id, verbose)
    while True:
        if store.exists(run.grow):
            store.remove(run.grow)
        try:
            summaries = _launch_once(spark, spec, size, monitor, profile)
        except LostProcesses as lost:
            resumed = (store.checkpoint_epochs(spec.run_id) or [0])[-1]
            size.after_loss(lost.__cause__, resumed)
            logger.warning(
                "run %s: the training job lost processes (%s); starting it again with "
                "%d from epoch %d (restart %d of at most %d)",
                spec.run_id,
                lost_reason(lost.__cause__),
                size.procs,
                resumed,
                size.restarts,
                size.max_restarts,
            )
            continue
        if not any(s["paused"] for s in summaries):
            return [RankSummary(**s) for s in summaries], [r.as_dict() for r in size.resizes]
        resumed = store.checkpoint_epochs(spec.run_id)[-1]
        size.after_growth_request(resumed)
        logger.info(
            "run %s: slots returned; starting the job again with %d processes from epoch %d",
            spec.run_id,
            size.procs,
            resumed,
        )


def _launch_once(
    spark: SparkSession, spec: TrainSpec, size: ElasticSize, monitor: FitMonitor, profile
) -> list[dict]:
    """One launch of the training job, followed from the driver by ``monitor``. Raises a
    TrainingError for an error of the training code, ``LostProcesses`` for any other
    failure; asks the ranks to grow when slots return (``ElasticSize``)."""
    store, run_id = spec.store, spec.run_id
    failure = store.run(run_id).failure(spec.launch_id)
    tag = f"spark-estimator-{spec.launch_id}"
    monitor.cancel = functools.partial(cancel_jobs, spark, tag)
    # Lightning's trainer has no way to stop for the driver: its fits only shrink (our
    # loop's ranks stop at an epoch's end where they find the growth request)
    grow = functools.partial(request_growth, store, store.run(run_id), size)
    monitor.watch = grow if spec.trainer == "torch" else None
    try:
        with monitor:
            return run_barrier_job(
                spark,
                size.procs,
                # a fresh rendezvous secret for each barrier job (SealedStore)
                functools.partial(training_task, replace(spec, secret=launch_secret())),
                f"spark-estimator {run_id}",
                tag=tag,
                profile=profile,
            )
    except Exception as e:
        wait_for_job_tasks(spark, tag)  # the job's other tasks end before the fit raises
        if (record := read_failure(failure, store)) is not None:
            error = TrainingError(run_id, record, monitor.tail(record["rank"]))
            error.spark_error = e  # not chained: its traceback repeats the error's
            raise error from None
        if hasattr(e, "add_note") and monitor.tail():
            e.add_note(f"last output of the ranks of run '{run_id}':\n{monitor.tail()}")
        raise LostProcesses() from e
