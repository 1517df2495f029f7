"""The rank side of a tuning trial's channel (``shared.pruning``), against a real store and
the driver's side (``driver.trial_watch``) in a thread of this process."""

from __future__ import annotations

import pytest

from spark_estimator.callbacks import TrainingState
from spark_estimator.driver.trial_watch import TrialWatch
from spark_estimator.shared import pruning


def test_rank_zero_stops_the_run_at_the_epoch_the_tuner_prunes(store):
    asked = []

    def decide(epoch: int, value: float) -> bool:
        asked.append((epoch, value))
        return epoch == 2

    callback = pruning.TrialPruning(store, "r", "validation.loss")
    state = TrainingState(rank=0, world_size=2, model=None, optimizer=None)
    with TrialWatch(store, "r", decide):
        for epoch in (1, 2):
            callback.on_epoch_end(epoch, {"validation": {"loss": 1.0 / epoch}}, state)
            assert state.stop_training is (epoch == 2)
    assert asked == [(1, 1.0), (2, 0.5)]
    other = TrainingState(rank=1, world_size=2, model=None, optimizer=None)
    callback.on_epoch_end(3, {"validation": {"loss": 0.1}}, other)  # rank 1 asks nothing
    assert not store.exists(store.run("r").trial_report(3))


def test_no_answer_means_go_on(store, monkeypatch):
    monkeypatch.setattr(pruning, "ANSWER_TIMEOUT_S", 0.05)  # the driver is gone
    assert pruning.ask_tuner(store, "r", 1, 1.0) is False


def test_a_lightning_metric_is_read_from_the_split_that_logged_it():
    record = {"train": {"loss": 2.0, "train_acc": 0.5}, "validation": {"val_loss": 1.5}}
    assert pruning.history_value(record, "val_loss", lightning=True) == 1.5
    assert pruning.history_value(record, "train_acc", lightning=True) == 0.5
    assert pruning.history_value(record, "train.loss", lightning=False) == 2.0
    with pytest.raises(KeyError, match="metric: 'val_acc'"):
        pruning.history_value(record, "val_acc", lightning=True)
