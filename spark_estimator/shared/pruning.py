"""The channel by which a tuning trial's fit asks the tuner, after each epoch, whether to go
on: built on the driver (``OptunaSearch`` adds a callback to the trial's estimator), run on
rank 0.

Rank 0 writes the epoch's value of the trial's metric to ``runs/<run_id>/trial/epoch-<n>.json``
and waits for the tuner's ``answer-<n>.json`` (``{"prune": bool}``): the tuner's watch
(``driver.trial_watch``) reports the value to the Optuna trial and asks its pruner. The
answer reaches every rank as EarlyStopping's request does: our loop broadcasts rank 0's
``stop_training`` after each epoch, so every rank ends the run at that epoch's end; in a
Lightning Trainer the callback broadcasts the answer itself and sets ``trainer.should_stop``.

An epoch answered before (a launch started again from an earlier checkpoint, a trial
resumed by a later fit) is not asked again: its answer stands. An answer that does not come
within ``ANSWER_TIMEOUT_S`` (the driver is gone) counts as "go on". The tuner answers
"abort" to the ranks of a trial it left running (its search interrupted: their job is
cancelled, but a rank may outlive it for a moment): rank 0 raises ``TrialAborted`` before
the epoch's checkpoint, so the run stays as the trial was left.
"""

from __future__ import annotations

import functools
import logging
import time

from ..callbacks import Callback, TrainingState, monitored_value
from ..store import Store

ANSWER_TIMEOUT_S = 300.0
# how often a local (or mounted) store is looked at for a report or an answer; a remote one
POLL_S = {"file": 0.005}
REMOTE_POLL_S = 0.2
log = logging.getLogger(__name__)


def poll_s(store: Store) -> float:
    """How long to wait between two looks at ``store`` for a file another process writes."""
    return POLL_S.get(store.protocol, REMOTE_POLL_S)


class TrialAborted(RuntimeError):
    """The tuner ended the trial (its search was interrupted): raised on rank 0."""


def ask_tuner(store: Store, run_id: str, epoch: int, value: float) -> bool:
    """Report ``value`` of ``epoch`` to the tuner and wait for its answer: whether the
    trial is pruned (stops at this epoch's end). Called on rank 0."""
    run = store.run(run_id)
    answer = run.trial_answer(epoch)
    if not store.exists(answer):
        store.write_json(run.trial_report(epoch), {"epoch": epoch, "value": value})
    deadline, every = time.monotonic() + ANSWER_TIMEOUT_S, poll_s(store)
    while not store.exists(answer):
        if time.monotonic() >= deadline:
            log.warning(
                "tuning: no answer from the tuner %.0f s after epoch %d's value; going on "
                "without pruning",
                ANSWER_TIMEOUT_S,
                epoch,
            )
            return False
        time.sleep(every)
    answered = store.read_json(answer)
    if answered.get("abort"):
        raise TrialAborted(f"run {run_id}: the tuner ended this trial after epoch {epoch}")
    return bool(answered["prune"])


class TrialPruning(Callback):
    """TorchEstimator's trial callback: rank 0 reports ``metric`` of each epoch and stops
    the run where the tuner prunes the trial (every rank stops with it)."""

    def __init__(self, store: Store, run_id: str, metric: str):
        self.store, self.run_id, self.metric = store, run_id, metric

    def on_epoch_end(self, epoch: int, logs: dict, state: TrainingState) -> None:
        if state.rank != 0:
            return
        if ask_tuner(self.store, self.run_id, epoch, monitored_value(logs, self.metric)):
            state.stop_training = True


@functools.cache
def lightning_trial_pruning(pl) -> type:
    """LightningEstimator's trial callback class, on Lightning package ``pl``'s Callback:
    rank 0 reports the value the module logged as ``metric`` at each training epoch's end
    (after its validation), and every rank sets ``trainer.should_stop`` where the tuner
    prunes the trial."""

    class LightningTrialPruning(pl.Callback):
        def __init__(self, store: Store, run_id: str, metric: str):
            self.store, self.run_id, self.metric = store, run_id, metric

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            prune = False
            if trainer.is_global_zero:
                value = trainer.callback_metrics.get(self.metric)
                if value is None:
                    raise KeyError(
                        f"metric: the module logged no '{self.metric}' this epoch; it logged "
                        f"{sorted(trainer.callback_metrics)}"
                    )
                value = float(value)
                epoch = trainer.current_epoch + 1
                prune = ask_tuner(self.store, self.run_id, epoch, value)
            if trainer.strategy.broadcast(prune, src=0):
                trainer.should_stop = True

    return LightningTrialPruning


def history_value(record: dict, metric: str, lightning: bool) -> float:
    """The value of ``metric`` in an epoch's history record: ``split.name`` of ours, or a
    name a LightningModule logged (in its validation record, else its training one)."""
    if not lightning:
        return monitored_value(record, metric)
    for split in ("validation", "train"):
        if metric in (record.get(split) or {}):
            return float(record[split][metric])
    raise KeyError(f"metric: '{metric}' is not in the epoch's record {record}")
