"""Driver: how many processes a fit's job runs with, launch after launch (elastic training).

A fit's barrier job fails as a whole when one of its processes is lost (a killed process,
a lost executor, a host gone). Unless a rank recorded an error of the training code
(``record_failure``), the driver starts the job again, at most ``max_restarts`` times,
and the ranks resume from the last checkpoint. ``ElasticSize`` decides with how many
processes: a fixed-size fit (``min_num_proc`` unset) waits for ``num_proc`` task slots; an
elastic one takes what the cluster offers, between ``min_num_proc`` and ``num_proc``. Either
waits at most ``elastic_timeout`` seconds, then fails with the slot counts it saw.

While an elastic fit runs with fewer than ``num_proc`` processes, ``grow_to`` says when the
cluster offers more slots again; the driver then asks the ranks to stop
(``request_growth``: the run's ``elastic/grow.json``), at the end of the epoch for a fit, at
the next ``state.commit()`` or ``check_host_updates()`` for an ``hvd.elastic`` script of
``run`` (``hvd.elastic``); they commit and return, and the job is started again
larger (``after_growth_request``), which is no restart: it does not count against
``max_restarts``. Every change of size is a ``Resize`` in a fit's training summary.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from pyspark.sql import SparkSession

from ..store import RunFolder, Store
from .launch import connect_slots, is_connect, master_slots, scheduler_slots

SLOT_POLL_S = 0.5
MAX_RESTARTS = 3  # the default of max_restarts (fits and run())
ELASTIC_TIMEOUT_S = 600.0  # the default of elastic_timeout (fits and run())


@dataclass(frozen=True)
class Resize:
    """One change of a fit's number of processes."""

    seconds: float  # since the fit's first launch
    from_procs: int
    to_procs: int
    why: str  # "lost processes: <Spark's error>" or "slots returned"
    resumed_epoch: int | None  # the last finished epoch the training went on from (fits)

    def as_dict(self) -> dict:
        return asdict(self)


def lost_reason(error: BaseException) -> str:
    """The gist of Spark's error about a failed job: the line naming the lost task."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if "Lost" in line or "lost" in line or "exited" in line:
            return line[:300]
    return (lines or [type(error).__name__])[0][:300]


def slots_now(spark: SparkSession, profile=None) -> int | None:
    """Task slots the cluster offers now (for the tasks of a task resource ``profile``,
    when given): the scheduler's count; on Spark Connect the server's configuration's, None
    where it does not tell."""
    if is_connect(spark):
        return connect_slots(spark, profile)
    counted = scheduler_slots(spark, profile)
    return master_slots(spark, profile) if counted is None else counted


class ElasticSize:
    """The size of each launch of one fit (see the module); its slots are those of the
    training job's task resource ``profile`` where it has one (``stage_profile``)."""

    def __init__(
        self,
        spark: SparkSession,
        num_proc: int,
        min_num_proc: int | None,
        start_procs: int,
        max_restarts: int,
        timeout_s: float,
        profile=None,
    ):
        self.spark, self.num_proc, self.profile = spark, num_proc, profile
        self.min_num_proc = num_proc if min_num_proc is None else min_num_proc
        self.max_restarts, self.timeout_s = max_restarts, timeout_s
        self.procs, self.restarts = start_procs, 0
        self.started = time.monotonic()
        self.resizes: list[Resize] = []

    @property
    def elastic(self) -> bool:
        return self.min_num_proc < self.num_proc

    def after_loss(self, error: BaseException, resumed_epoch: int | None = None) -> int:
        """The size of the next launch after one that lost processes with ``error`` (Spark's
        error); waits for enough slots. Raises a RuntimeError when the restarts are used up
        or the slots do not come."""
        self.restarts += 1
        if self.restarts > self.max_restarts:
            raise RuntimeError(
                f"the training job lost processes {self.restarts} times, more than "
                f"max_restarts={self.max_restarts}; the last time: {lost_reason(error)}"
            ) from error
        procs = self._wait_for_slots()
        self._resize(procs, f"lost processes: {lost_reason(error)}", resumed_epoch)
        return procs

    def grow_to(self) -> int | None:
        """A larger size the cluster can run now, while this one is below ``num_proc``."""
        if not self.elastic or self.procs >= self.num_proc:
            return None
        slots = slots_now(self.spark, self.profile)
        return min(slots, self.num_proc) if slots is not None and slots > self.procs else None

    def after_growth_request(self, resumed_epoch: int | None) -> int:
        """The size of the next launch after the ranks stopped for the job to grow (at an
        epoch's end: ``resumed_epoch``; None for ``run``)."""
        procs = max(self.procs, min(slots_now(self.spark, self.profile) or 0, self.num_proc))
        self._resize(procs, "slots returned", resumed_epoch)
        return procs

    def _resize(self, procs: int, why: str, resumed_epoch: int | None) -> None:
        if procs != self.procs:
            seconds = round(time.monotonic() - self.started, 3)
            self.resizes.append(Resize(seconds, self.procs, procs, why, resumed_epoch))
        self.procs = procs

    def _wait_for_slots(self) -> int:
        """At least ``min_num_proc`` slots (``num_proc`` when not elastic), at most
        ``num_proc``, waiting up to ``timeout_s`` for them. Where the slots cannot be
        counted (Spark Connect without them in its configuration), the same size as before:
        Spark itself refuses a barrier job larger than the cluster."""
        began = time.monotonic()
        seen: list[tuple[float, int]] = []
        while True:
            slots = slots_now(self.spark, self.profile)
            if slots is None:
                return self.procs
            if not seen or seen[-1][1] != slots:
                seen.append((time.monotonic() - began, slots))
            if slots >= self.min_num_proc:
                return min(slots, self.num_proc)
            if time.monotonic() - began >= self.timeout_s:
                counts = ", ".join(f"{n} at {t:.0f} s" for t, n in seen)
                name = "min_num_proc" if self.elastic else "num_proc"
                raise RuntimeError(
                    f"{name}: the cluster offered fewer than {self.min_num_proc} task slots "
                    f"for elastic_timeout={self.timeout_s:g} s after the training job lost "
                    f"processes (slots seen since then: {counts}); the fit stops. Its "
                    "checkpoints stay in the store: fit again with the same run_id to resume"
                )
            time.sleep(SLOT_POLL_S)


def request_growth(store: Store, run: RunFolder, size: ElasticSize) -> bool:
    """While the job runs below its largest size and the cluster offers more slots, ask
    its ranks to stop so that it can start again larger: ``run.grow`` names the size the
    request is for (a launch of another size ignores it). Whether a request is there now."""
    if store.exists(run.grow):
        return True
    if size.grow_to() is None:
        return False
    store.write_json(run.grow, {"from": size.procs})
    return True
