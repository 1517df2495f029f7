"""Executor: the entry point of one barrier task of a fit."""

from __future__ import annotations

from dataclasses import asdict

from ..shared.failures import record_failure
from ..shared.spec import TrainSpec
from .comm.meeting import Meeting
from .comm.rendezvous import process_group
from .loop.train import train
from .observe.run_log import RankLog


def training_task(spec: TrainSpec) -> dict:
    """Run this task's rank of the training job; return its summary (a ``RankSummary`` as a
    dict, for the job's JSON). An error of the training code is recorded in the store
    first (see ``record_failure``)."""
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    store = spec.store
    path = store.run(spec.run_id).failure(spec.launch_id)

    def on_failure(rank: int, error: BaseException) -> None:
        record_failure(path, store, rank, error)

    rank, attempt = ctx.partitionId(), ctx.taskAttemptId()  # unique, rising over retries
    meeting = Meeting(store, store.run(spec.run_id), spec.launch_id, spec.secret)
    with RankLog(store, spec.run_id, spec.launch_id, rank, attempt, spec.echo) as log:
        with process_group(
            ctx, meeting, spec.use_gpu, spec.collective_timeout, on_failure, on_error=log.write_now
        ) as info:
            if spec.trainer == "lightning":  # imported here: lightning is an optional extra
                from .lightning.train import train_lightning

                return asdict(train_lightning(spec, info, log.report))
            return asdict(train(spec, info, log.report))
