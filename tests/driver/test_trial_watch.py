"""The tuner's side of a trial's channel (``driver.trial_watch``), against a real store and
rank 0's side (``shared.pruning``) called from this process."""

from __future__ import annotations

import time

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


def test_a_report_an_earlier_fit_left_unanswered_is_not_taken_for_the_next_fits(store):
    """A driver killed while rank 0 waited for epoch 3's answer (and an interrupted search's
    "abort" of epoch 2 in another run) leaves a report no fit goes on from: the epoch was
    not checkpointed and is trained again, so the next fit's watch waits for its own
    report of it."""
    run = store.run("r")
    store.write_json(run.trial_report(1), {"epoch": 1, "value": 3.0})
    store.write_json(run.trial_answer(1), {"prune": False})
    store.write_json(run.trial_report(2), {"epoch": 2, "value": 2.5})  # unanswered
    asked = []
    with TrialWatch(store, "r", lambda epoch, value: asked.append((epoch, value)) or False):
        time.sleep(0.2)
        assert asked == []  # the stale report of epoch 2 is not answered
        assert pruning.ask_tuner(store, "r", 2, 2.0) is False
    assert asked == [(2, 2.0)]

    other = store.run("s")
    store.write_json(other.trial_report(1), {"epoch": 1, "value": 1.0})
    store.write_json(other.trial_answer(1), {"prune": True, "abort": True})
    asked.clear()
    with TrialWatch(store, "s", lambda epoch, value: asked.append((epoch, value)) or False):
        time.sleep(0.2)
        assert asked == [] and not store.exists(other.trial_report(1))
        assert pruning.ask_tuner(store, "s", 1, 0.5) is False
    assert asked == [(1, 0.5)]
