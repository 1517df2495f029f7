"""Driver: run an Optuna study whose trials are fits (``OptunaSearch.fit``).

The driver owns the loop (Optuna's ask and tell; no ``optimize``): it asks for a trial only
when one can start, builds its fit (``trials.plan_trial``: the space is called here, on the
driver thread, in trial order) and starts it in a thread of its own. Admission is decided
here, from the task slots counted once (``launch.available_slots``, under the estimator's
task resource profile, so GPUs count as a fit counts them): at most ``parallelism`` trials
run at once, and a trial starts only when its ``num_proc`` slots are free; the others wait
in the tuner, never as a barrier job waiting on slots another trial holds.

Each running trial has a ``TrialWatch`` that answers rank 0's epoch reports: the value goes
to ``trial.report`` and the pruner's ``should_prune`` answers; a pruned fit stops at that
epoch's end on every rank and the trial is told PRUNED. A fit that raises (its training
code, NaN losses with ``terminate_on_nan``, a param value its checks refuse) makes a FAIL
trial with the error in its user attributes, and the study goes on. Every trial of a study
trains from one dataset: fits of the same data at once materialize it once
(``cache_key.one_writer``); params that change the data (``validation``, ``random_seed``)
make one dataset per value, said once in a warning.

A study kept in a storage survives its driver: a later fit of the same study name finds
the trials that were running (left RUNNING by a driver that was killed, or interrupted)
and takes each up again with its own params and run, which resumes from the run's last
checkpoint (``run_id``); it then asks for new trials until the study holds ``n_trials``.
A trial left running whose run had ended (its driver gone before recording it) is
recorded as its run ended: pruned with its last reported value, or, where it completed
(its model went with the driver), failed and fit again as a new trial with its params
(enqueued, so a driver killed again still finds it), counted in its place. The sampler of
such a later fit is seeded anew (``study_sampler``), so its trials are not those the
sampler gave the first fit.
"""

from __future__ import annotations

import copy
import functools
import logging
import sys
import threading
import time
from contextlib import nullcontext
from typing import Any

from pyspark import inheritable_thread_target
from pyspark.sql import DataFrame

from ..store import Store
from . import mlflow_log
from .launch import available_slots, cancel_jobs, labelled_jobs
from .monitor import logging_configured
from .persistence import in_store
from .stage_profile import task_profile
from .trial_watch import TrialWatch
from .trials import (
    EPOCHS_ATTR,
    ERROR_ATTR,
    FIT_AGAIN_AS_ATTR,
    FIT_AGAIN_OF_ATTR,
    FIT_SECONDS_ATTR,
    RUN_ID_ATTR,
    TrialPlan,
    check_metric,
    ended_run,
    plan_trial,
    trained_epochs,
    trial_line,
    trial_params,
    trial_value,
)

logger = logging.getLogger("spark_estimator.tuning")
INSTALL = "pip install 'spark-estimator[tune]' (or optuna)"
WAIT_S = 0.5  # how often a waiting loop looks at the clock (timeout)


def require_optuna():
    """The optuna module, or an ImportError saying how to install it."""
    try:
        import optuna
    except ImportError as e:
        raise ImportError(f"OptunaSearch needs Optuna on the driver: {INSTALL}") from e
    return optuna


def open_storage(storage, store: Store, study_name: str):
    """The Optuna storage ``storage`` names: None (in memory), "store" (a journal file in
    the store, which must be a filesystem with file locks), a URL or a storage object."""
    optuna = require_optuna()
    if storage != "store":
        return storage
    if store.protocol != "file":
        raise ValueError(
            f"storage: 'store' keeps the study in a journal file, which needs file locks: a "
            f"local or shared filesystem, not {store.url}; give an Optuna storage URL "
            "(e.g. 'postgresql://...' or 'sqlite:///study.db') instead"
        )
    path = store.study_journal(study_name)
    store.fs.makedirs(store.join("studies"), exist_ok=True)
    backend = optuna.storages.journal.JournalFileBackend(path)
    return optuna.storages.JournalStorage(backend)


def study_sampler(sampler, seed: int | None, held: int):
    """The sampler of a fit of a study that holds ``held`` trials already: the default
    TPESampler seeded ``seed + held`` (``seed`` itself for a new study, so one uninterrupted
    fit gives the trials that seed gives), or a copy of the given ``sampler`` with its
    random state drawn anew (``reseed_rng``) where the study holds trials, so that a later
    fit does not draw the first fit's params again."""
    optuna = require_optuna()
    if sampler is None:
        return optuna.samplers.TPESampler(seed=None if seed is None else seed + held)
    if not held:
        return sampler
    sampler = copy.deepcopy(sampler)
    sampler.reseed_rng()
    return sampler


class StudyRun:
    """One ``fit`` of an OptunaSearch: the study's trials run until it holds ``n_trials``
    or ``timeout`` passed."""

    def __init__(self, search, df: DataFrame, study, direction_sign: float):
        self.search, self.df, self.study = search, df, study
        self.spark = df.sparkSession
        self.base = search.getEstimator()
        self.space, self.metric = search.getSpace(), search.getMetric()
        self.evaluator = search.getEvaluator()
        self.n_trials, self.timeout = search.getNTrials(), search.getTimeout()
        self.parallelism = search.getParallelism()
        self.sign = direction_sign  # reported values: metric * sign has the study's direction
        self.verbose = search.getVerbose() and not logging_configured(logger)
        self.mlflow = self.base.getMlflowLogging()
        # a study that may outlive this fit (a storage, or one given): its best model is
        # saved where a later fit finds it
        self.kept = search.getStorage() is not None or search.getStudy() is not None
        self.models: dict[int, Any] = {}  # trial number -> fitted model of the best so far
        self.datasets: set[str] = set()  # the datasets trials trained on
        self.lock = threading.Condition()
        self.running: dict[int, TrialPlan] = {}
        self.threads: list[threading.Thread] = []
        self.free = 0  # task slots no running trial holds
        self.interrupted = False
        self.started = time.monotonic()

    # -- the loop -------------------------------------------------------------------------
    def run(self) -> None:
        est = self.base
        profile = task_profile(self.spark, est.getStageLevelScheduling(), est.getUseGpu()).profile
        self.slots = available_slots(self.spark, est.getNumProc(), profile=profile)
        self.free = self.slots
        self.procs = min(est.getNumProc() or self.slots, self.slots)
        pending = self._left_running()
        if pending:
            logger.info(
                "study %s: taking up %d trial(s) an earlier fit left running: %s",
                self.study.study_name,
                len(pending),
                [t.number for t, _ in pending],
            )
        study_run = mlflow_log.study_run(self.study.study_name) if self.mlflow else nullcontext()
        with study_run as parent:
            self.parent_run = parent
            try:
                first = True
                while True:
                    # the next trial is asked for once it can start (its sampler then
                    # knows every trial that ended before), on the slots a fit of the
                    # estimator takes; a space that changes num_proc waits again below
                    if not self._wait(self._room):
                        break
                    resumed = bool(pending)
                    if not resumed and not self._fit_again() and not self._more_trials():
                        break
                    trial, reported = pending.pop(0) if resumed else (self.study.ask(), set())
                    plan = self._plan(trial, resumed, check=first)
                    plan.reported_before = reported
                    first = False
                    self._wait(lambda need=plan.procs: self.free >= need, admit=plan)
                    self._start(plan)
            except BaseException as e:
                if not isinstance(e, Exception):  # Ctrl-C: the running trials stay RUNNING
                    self.interrupted = True
                    self._stop_running()
                raise
            finally:
                for thread in self.threads:
                    thread.join()

    def _left_running(self) -> list[tuple[Any, set[int]]]:
        """The trials an earlier fit left running, to take up again (a FrozenTrial's
        storage id makes the Trial that reports to it), each with the epochs it reported;
        those whose run had ended are recorded here instead (``_record_ended``)."""
        optuna = require_optuna()
        store = self.base.getStore()
        stale = self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        pending = []
        for frozen in stale:
            run_id = frozen.user_attrs.get(RUN_ID_ATTR)
            if run_id is not None and store.exists(store.run(run_id).result):
                self._record_ended(frozen, run_id)
            else:
                trial = optuna.Trial(self.study, frozen._trial_id)
                pending.append((trial, set(frozen.intermediate_values)))
        return pending

    def _record_ended(self, frozen, run_id: str) -> None:
        """Record a trial whose run ended before its driver recorded it, with its own run's
        epochs: pruned (its value the last it reported), or failed and fit again as a new
        trial of its params (its model is gone with the driver that fitted it)."""
        optuna = require_optuna()
        states = optuna.trial.TrialState
        store = self.base.getStore()
        epochs, pruned = ended_run(store, run_id)
        trial = optuna.Trial(self.study, frozen._trial_id)
        trial.set_user_attr(EPOCHS_ATTR, epochs)
        try:  # the epochs the trial's fit had (the space may set them)
            total = trial_params(self.base, self.space(trial)).get("epochs")
        except Exception:
            total = None
        total = total or self.base.getEpochs()
        if pruned:
            frozen = self.study.tell(trial, state=states.PRUNED)
            value = frozen.value * self.sign if frozen.value is not None else None
            note = f"recorded from its run {run_id}, which ended before its driver was gone"
            self._show(
                trial_line(
                    frozen.number,
                    frozen.params,
                    total,
                    "pruned",
                    epochs,
                    value,
                    self.metric,
                    None,
                    error=note,
                )
            )
            return
        number = self._enqueue_again(frozen)
        error = (
            f"its fit ended (run {run_id}, {epochs} epoch{'s' if epochs != 1 else ''}) but "
            "the driver running the study was gone before recording it, and the fitted "
            f"model with it; fit again as trial {number}"
        )
        trial.set_user_attr(ERROR_ATTR, error)
        trial.set_user_attr(FIT_AGAIN_AS_ATTR, number)
        self.study.tell(trial, state=states.FAIL)
        self._show(
            trial_line(
                frozen.number,
                frozen.params,
                total,
                "failed",
                epochs,
                None,
                self.metric,
                None,
                error=error,
            )
        )

    def _enqueue_again(self, frozen) -> int:
        """The number of the trial that fits ``frozen``'s params again: enqueued now, or
        found where an earlier fit enqueued it before it could record ``frozen``."""

        def again():
            for t in self.study.get_trials(deepcopy=False):
                if t.user_attrs.get(FIT_AGAIN_OF_ATTR) == frozen.number:
                    return t.number
            return None

        number = again()
        if number is None:
            self.study.enqueue_trial(frozen.params, user_attrs={FIT_AGAIN_OF_ATTR: frozen.number})
            number = again()
        return number

    def _fit_again(self) -> bool:
        """Whether a trial enqueued to fit again a trial whose model was lost waits: it is
        asked whatever ``n_trials`` (it counts in the lost trial's place)."""
        waiting = require_optuna().trial.TrialState.WAITING
        return any(
            FIT_AGAIN_OF_ATTR in t.user_attrs
            for t in self.study.get_trials(deepcopy=False, states=(waiting,))
        )

    def _stop_running(self) -> None:
        """Cancel the running trials' jobs until their fits end (a fit starts its job again
        after a loss, up to its max_restarts); their trials are left RUNNING, for a later
        fit of the study to take up again, and a rank that outlives its job is answered
        "abort" at its next epoch's end (``TrialWatch``)."""
        while any(thread.is_alive() for thread in self.threads):
            for plan in list(self.running.values()):
                cancel_jobs(self.spark, _tag(plan))
            for thread in self.threads:
                thread.join(WAIT_S)

    def _room(self) -> bool:
        """Whether another trial may start: fewer than ``parallelism`` run, and the slots a
        fit of the tuned estimator takes are free."""
        return len(self.running) < self.parallelism and self.free >= self.procs

    def _more_trials(self) -> bool:
        if self.timeout is not None and time.monotonic() - self.started >= self.timeout:
            return False
        if self.n_trials is None:
            return True
        trials = self.study.get_trials(deepcopy=False)
        counted = [t for t in trials if FIT_AGAIN_AS_ATTR not in t.user_attrs]
        return len(counted) < self.n_trials

    def _wait(self, ready, admit: TrialPlan | None = None) -> bool:
        """Wait until ``ready()``; with ``admit``, then hold its slots as a running trial.
        Without, False where the timeout passed first (a trial asked for is let in)."""
        with self.lock:
            while not ready():
                timed_out = self.timeout is not None and (
                    time.monotonic() - self.started >= self.timeout
                )
                if timed_out and admit is None:
                    return False
                self.lock.wait(WAIT_S)
            if admit is not None:
                self.free -= admit.procs
                self.running[admit.number] = admit
        return True

    def _plan(self, trial, resumed: bool, check: bool) -> TrialPlan:
        """The trial's fit; a space or metric that cannot work fails the trial and raises."""
        try:
            plan = plan_trial(self.base, trial, self.space, self.metric, self.slots, resumed)
            if check:
                check_metric(plan.estimator, self.metric)
        except Exception as e:
            self.study.tell(trial, state=require_optuna().trial.TrialState.FAIL)
            raise e
        return plan

    def _start(self, plan: TrialPlan) -> None:
        target = inheritable_thread_target(self.spark)(self._trial_thread)
        thread = threading.Thread(target=target, args=(plan,), name=f"trial-{plan.number}")
        self.threads.append(thread)
        thread.start()

    # -- one trial, in its own thread -------------------------------------------------------
    def _trial_thread(self, plan: TrialPlan) -> None:
        try:
            self._run_trial(plan)
        except Exception as e:  # the study's storage, MLflow...: the trial's line says it
            logger.exception("trial %d: the tuner failed to record it: %s", plan.number, e)
        finally:
            with self.lock:
                self.free += plan.procs
                self.running.pop(plan.number, None)
                self.lock.notify_all()

    def _run_trial(self, plan: TrialPlan) -> None:
        optuna = require_optuna()
        states = optuna.trial.TrialState
        started = time.monotonic()
        mlflow_run = (
            mlflow_log.trial_run(self.parent_run, plan.number, plan.trial.params)
            if self.mlflow
            else nullcontext(lambda state, value: None)
        )
        label = f"spark-estimator trial {plan.number} of {self.study.study_name}"
        with labelled_jobs(self.spark, label, _tag(plan)), mlflow_run as end_run:
            decide = functools.partial(self._decide, plan)
            try:
                store, interrupted = plan.estimator.getStore(), lambda: self.interrupted
                with TrialWatch(store, plan.run_id, decide, aborted=interrupted):
                    model = plan.estimator.fit(self.df)
            except Exception as e:
                if self.interrupted:
                    return  # left RUNNING: a later fit takes it up again
                error = f"{type(e).__name__}: {e}".splitlines()[0][:500]
                epochs = trained_epochs(plan.estimator.getStore(), plan.run_id, plan.reported)
                plan.trial.set_user_attr(ERROR_ATTR, error)
                plan.trial.set_user_attr(EPOCHS_ATTR, epochs)
                self.study.tell(plan.trial, state=states.FAIL)
                end_run("fail", None)
                self._line(plan, "failed", epochs, None, started, error=error)
                return
            epochs = len(model.getHistory())
            self._note_dataset(plan)
            plan.trial.set_user_attr(EPOCHS_ATTR, epochs)
            plan.trial.set_user_attr(
                FIT_SECONDS_ATTR, model.getTrainingSummary()["fit_seconds"]["total"]
            )
            if plan.pruned_at is not None:
                value = plan.reported[-1][1]
                self.study.tell(plan.trial, state=states.PRUNED)
                end_run("pruned", value)
                self._line(plan, "pruned", epochs, value, started)
            else:
                value = trial_value(plan, model, self.metric, self.evaluator, self.df)
                frozen = self.study.tell(plan.trial, value)
                best = frozen.state == states.COMPLETE and self._keep_if_best(plan, model)
                state = "complete" if frozen.state == states.COMPLETE else "failed"
                end_run("complete" if state == "complete" else "fail", value)
                self._line(plan, state, epochs, value, started, best=best)

    def _decide(self, plan: TrialPlan, epoch: int, value: float) -> bool:
        """Report the epoch's value to the trial; whether its pruner stops it here (never
        at the fit's last epoch, which ends it anyway)."""
        plan.reported.append((epoch, value))
        if epoch not in plan.reported_before:  # a step reported once keeps its first value
            plan.trial.report(value * self.sign, epoch)
        if epoch >= plan.estimator.getEpochs() or not plan.trial.should_prune():
            return False
        plan.pruned_at = epoch
        return True

    def _keep_if_best(self, plan: TrialPlan, model) -> bool:
        """Keep ``model`` where its trial is the study's best now (the earlier best's model
        is dropped); in a study that may outlive this fit also save it to the trial's run
        (``tuned_model``), where a later fit of the study finds it. Whether it is the best."""
        with self.lock:
            if self.study.best_trial.number != plan.number:
                return False
            self.models = {plan.number: model}
        if self.kept:
            store = plan.estimator.getStore()
            writer = model.write().overwrite()
            writer.save(in_store(writer, store, store.run(plan.run_id).tuned_model))
        return True

    def _note_dataset(self, plan: TrialPlan) -> None:
        """Warn where a trial trained on another dataset than the trials before it."""
        store = plan.estimator.getStore()
        key = store.read_json(store.run(plan.run_id).manifest)["data"]["dataset"]
        with self.lock:
            new = bool(self.datasets) and key not in self.datasets
            self.datasets.add(key)
        if new:
            logger.warning(
                "trial %d trained on a dataset of its own: its params change the rows or their "
                "split (validation, random_seed...), so each of their values writes (or checks) "
                "the data once more",
                plan.number,
            )

    def _line(self, plan, state, epochs, value, started, best=False, error=None) -> None:
        seconds = time.monotonic() - started
        total = plan.estimator.getEpochs()
        self._show(
            trial_line(
                plan.number,
                plan.trial.params,
                total,
                state,
                epochs,
                value,
                self.metric,
                seconds,
                best,
                error,
            )
        )

    def _show(self, line: str) -> None:
        logger.info(line)
        if self.verbose:
            print(line, file=sys.stderr, flush=True)


def _tag(plan: TrialPlan) -> str:
    return f"spark-estimator-{plan.run_id}"
