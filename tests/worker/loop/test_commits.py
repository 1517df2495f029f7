"""Commits inside an epoch (``commit_every_steps``): counted in optimizer steps, made only on a
batch that ends one, and an elastic fit's default interval, re-timed every epoch, never
dropping to none (the loop in this process: a real one-process gloo group, real Parquet)."""

import time

import torch

from spark_estimator.shared.serialization import state_from_bytes
from spark_estimator.shared.spec import COMMIT_AUTO, LoopSpec
from spark_estimator.worker.comm.ranks import RankInfo
from spark_estimator.worker.loop import commits
from spark_estimator.worker.loop import train as train_module
from tests.worker.loop.test_train import regression_spec

CPU = RankInfo(0, 1, 0, 1, torch.device("cpu"))


def committed(monkeypatch) -> list[tuple[int, int]]:
    """The (epoch, batches of the epoch trained) of every commit the loop makes."""
    made, real = [], train_module._TrainingLoop._commit

    def recorded(self, epoch, step, sums):
        made.append((epoch, step))
        return real(self, epoch, step, sums)

    monkeypatch.setattr(train_module._TrainingLoop, "_commit", recorded)
    return made


def fit(tmp_path, store, epochs=2, **loop) -> dict:
    """Train 80 rows in batches of 8 (10 batches an epoch); the run's training summary."""
    spec = regression_spec(tmp_path, store, rows=80, epochs=epochs, loop=LoopSpec(**loop))
    summary = train_module.train(spec, CPU)
    assert summary.batches_per_epoch == [10] * epochs
    return state_from_bytes(store.read_bytes(store.run("r").result))["summary"]


def test_commit_every_steps_counts_optimizer_steps_not_batches(
    tmp_path, store, process_group, monkeypatch
):
    """k=2: 5 optimizer steps an epoch (after batches 2, 4, 6, 8, 10); every 2 of them is a
    commit after batches 4 and 8 (10 ends the epoch: its checkpoint, not a commit)."""
    made = committed(monkeypatch)
    summary = fit(tmp_path, store, backward_passes_per_step=2, commit_every_steps=2)
    assert made == [(1, 4), (1, 8), (2, 4), (2, 8)]
    assert summary["commits"] == 4


def test_the_elastic_default_commits_on_a_batch_that_ends_an_optimizer_step(
    tmp_path, store, process_group, monkeypatch
):
    """k=4: the epoch's groups end after batches 4, 8 and 10 (3 optimizer steps); the first
    epoch's one timed commit is in its middle, after the second step (batch 8), and every
    epoch commits at least once, never inside a group (its gradients are not in a commit)."""
    made = committed(monkeypatch)
    summary = fit(tmp_path, store, backward_passes_per_step=4, commit_every_steps=COMMIT_AUTO)
    assert made[0] == (1, 8) and [m for m in made if m[0] == 1] == [(1, 8)]
    assert {epoch for epoch, _ in made} == {1, 2}
    assert all(step in (4, 8) for _, step in made)
    assert summary["commits"] == len(made)
    commit = state_from_bytes(store.read_bytes(store.run("r").step_commit))
    assert (commit["epoch"], commit["step"]) == made[-1]


def test_an_elastic_fit_whose_commit_was_slow_still_commits_in_later_epochs(
    tmp_path, store, process_group, monkeypatch
):
    """The first commit takes 0.5 s (a store slow for a moment), far over 5% of an epoch:
    later epochs commit once each, in their middle, timed again (they used to stop)."""
    made, real = committed(monkeypatch), commits.write
    slow = [True]

    def write(*args):
        if slow[0]:
            time.sleep(0.5)
            slow[0] = False
        return real(*args)

    monkeypatch.setattr(commits, "write", write)
    fit(tmp_path, store, epochs=3, commit_every_steps=COMMIT_AUTO)
    assert {epoch for epoch, _ in made} == {1, 2, 3}


def test_the_default_interval_is_bounded_by_a_floor_and_a_ceiling():
    assert commits.interval(COMMIT_AUTO, 10) == 5  # the first epoch: one, timed
    assert commits.interval(COMMIT_AUTO, 3) == 2  # in the middle: after step 2 of 3
    assert commits.interval(4, 3) == 4  # a set interval is kept (none in an epoch of 3)
    # 100 steps in 10 s with commits of 0.01 s: 4 an epoch (every 25 steps), the floor
    assert commits.adapted(100, 10.0, [0.01], 50) == 25
    # commits of 0.2 s against steps of ~0.1 s: every 40 steps keeps them at 5%
    assert commits.adapted(100, 10.2, [0.2], 50) == 40
    assert commits.adapted(100, 10.2, [0.2] * 3, 50) == 42  # 3 of them: 0.096 s a step
    # one commit costs over 5% of an epoch: one an epoch, in its middle (the ceiling),
    # timed again, never none
    assert commits.adapted(100, 1.5, [0.5], 50) == 50
    assert commits.adapted(101, 1.5, [0.5], 25) == 51
    assert commits.adapted(100, 10.0, [0.01], commits.adapted(100, 1.5, [0.5], 50)) == 25
    assert commits.adapted(3, 1.0, [0.001], 2) == 1  # never 0: at most one every step
    assert commits.adapted(100, 10.0, [], 50) == 50  # nothing timed: as it was
    # a short epoch (the rest after a commit) is timed, the bounds are the whole epoch's
    assert commits.adapted(10, 1.5, [0.5], 25, epoch_steps=100) == 50
