import torch

from spark_estimator.callbacks import BestModel, Callback, EarlyStopping
from spark_estimator.worker.loop.checkpoints import Checkpoints
from spark_estimator.worker.loop.resume import (
    agree_on_checkpoint,
    callback_states,
    restore_callbacks,
    seed_epoch,
)


def draws(seed, epoch, rank):
    seed_epoch(seed, epoch, rank)
    return torch.rand(4)


def test_each_epoch_and_rank_draws_its_own_numbers_the_same_every_time():
    assert torch.equal(draws(0, 2, 1), draws(0, 2, 1))  # a resumed epoch draws the same
    assert not torch.equal(draws(0, 2, 1), draws(0, 3, 1))
    assert not torch.equal(draws(0, 2, 1), draws(0, 2, 0))
    assert not torch.equal(draws(0, 2, 1), draws(1, 2, 1))


def test_callbacks_get_their_saved_state_back():
    stop, best = EarlyStopping(patience=2), BestModel()
    stop.best_value, stop.best_epoch, stop.wait = 0.5, 3, 1
    best.best_value, best.best_epoch = 0.5, 3
    saved = callback_states([stop, best])
    fresh = [EarlyStopping(patience=2), BestModel()]
    restore_callbacks(fresh, saved)
    assert (fresh[0].best_value, fresh[0].best_epoch, fresh[0].wait) == (0.5, 3, 1)
    assert (fresh[1].best_value, fresh[1].best_epoch) == (0.5, 3)


def test_other_callbacks_than_the_checkpoints_start_afresh():
    stop = EarlyStopping()
    stop.wait = 2
    fresh = [Callback(), EarlyStopping()]
    restore_callbacks(fresh, callback_states([stop]))
    assert fresh[1].wait == 0


def test_ranks_agree_on_the_newest_checkpoint(store, process_group):
    checkpoints = Checkpoints(store, "r", keep=None)
    assert agree_on_checkpoint(checkpoints, 0, torch.device("cpu")) == 0
    for epoch in (1, 2, 10):
        checkpoints.write(epoch, {"model": {}})
    assert agree_on_checkpoint(checkpoints, 0, torch.device("cpu")) == 10
