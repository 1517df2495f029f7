"""The tuner's side of a trial's channel (``driver.trial_watch``), against a real store and
rank 0's side (``shared.pruning``) called from this process."""

from __future__ import annotations

import pytest

from spark_estimator.driver.trial_watch import TrialWatch
from spark_estimator.shared import pruning


def test_an_epoch_answered_before_is_not_asked_again(store):
    """A launch started again from an earlier checkpoint, or a trial resumed by a new
    driver, reports epochs the tuner answered: the answers stand, decide is not called."""
    run = store.run("r")
    store.write_json(run.trial_report(1), {"epoch": 1, "value": 3.0})
    store.write_json(run.trial_answer(1), {"prune": False})
    asked = []
    with TrialWatch(store, "r", lambda epoch, value: asked.append(epoch) or True):
        assert pruning.ask_tuner(store, "r", 1, 2.0) is False  # the old answer
        assert store.read_json(run.trial_report(1))["value"] == 3.0  # not reported again
        assert pruning.ask_tuner(store, "r", 2, 1.0) is True
    assert asked == [2]


def test_a_decision_that_fails_answers_go_on(store):
    def broken(epoch: int, value: float) -> bool:
        raise ConnectionError("the study's storage is down")

    with TrialWatch(store, "r", broken):
        assert pruning.ask_tuner(store, "r", 1, 1.0) is False
    assert store.read_json(store.run("r").trial_answer(1)) == {"prune": False}


def test_an_interrupted_search_answers_abort_and_a_later_fit_of_the_trial_is_asked_again(store):
    interrupted = []
    with TrialWatch(store, "r", lambda epoch, value: False, aborted=lambda: bool(interrupted)):
        assert pruning.ask_tuner(store, "r", 1, 1.0) is False
        interrupted.append(True)
        with pytest.raises(pruning.TrialAborted, match="ended this trial after epoch 2"):
            pruning.ask_tuner(store, "r", 2, 0.9)
    asked = []
    with TrialWatch(store, "r", lambda epoch, value: asked.append(epoch) or False):
        assert pruning.ask_tuner(store, "r", 2, 0.8) is False  # the abort is gone
    assert asked == [2]
