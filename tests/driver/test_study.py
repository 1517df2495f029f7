"""The study's sampler across fits of one study (``driver.study.study_sampler``), with real
Optuna studies in memory."""

from __future__ import annotations

import pytest

optuna = pytest.importorskip("optuna")
from spark_estimator.driver.study import study_sampler  # noqa: E402


def draws(study, n: int) -> list[float]:
    """``n`` trials asked and told one after the other (parallelism=1): their params."""
    values = []
    for _ in range(n):
        trial = study.ask()
        values.append(trial.suggest_float("lr", 1e-4, 1e-1, log=True))
        study.tell(trial, values[-1])
    return values


def test_a_new_study_draws_the_seeds_trials_and_a_later_fit_draws_others():
    first = optuna.create_study(sampler=study_sampler(None, 7, 0))
    assert draws(first, 3) == draws(optuna.create_study(sampler=study_sampler(None, 7, 0)), 3)
    before = [t.params["lr"] for t in first.trials]
    # a later fit of the same study (its driver killed after 3 trials): seeded 7 + 3
    first.sampler = study_sampler(None, 7, 3)
    after = draws(first, 3)
    assert not set(after) & set(before)
    again = optuna.create_study(sampler=study_sampler(None, 7, 0))
    draws(again, 3)
    again.sampler = study_sampler(None, 7, 3)
    assert draws(again, 3) == after  # reproducible: the seed and the trials held decide


def test_a_given_sampler_is_used_as_is_in_a_new_study_and_reseeded_copy_in_a_later_fit():
    given = optuna.samplers.RandomSampler(seed=3)
    assert study_sampler(given, None, 0) is given
    study = optuna.create_study(sampler=given)
    before = draws(study, 2)
    study.sampler = study_sampler(given, None, 2)
    assert study.sampler is not given and isinstance(study.sampler, optuna.samplers.RandomSampler)
    assert not set(draws(study, 2)) & set(before)
    unseeded = study_sampler(None, None, 5)  # no seed: TPE at random, as before
    assert isinstance(unseeded, optuna.samplers.TPESampler)
