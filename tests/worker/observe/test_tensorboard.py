"""TensorBoardLog: event files TensorBoard's own reader reads back, one per run: the
per-epoch scalars and the step scalars, continued across resumes."""

from pathlib import Path

import pytest
import torch

from spark_estimator import Store
from spark_estimator.shared.history import epoch_scalars
from spark_estimator.worker.observe import tensorboard
from spark_estimator.worker.observe.tensorboard import TensorBoardLog, crc32c

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

HISTORY = [
    {
        "epoch": 1,
        "lr": [0.1, 0.01],
        "train": {"loss": 2.5, "mae": 1.25},
        "validation": {"loss": 3.0},
        "seconds": {
            "train": [2.0, 2.5],
            "data": [0.5, 1.0],
            "compute": [1, 1],
            "communication": [0.5, 0.5],
        },
    },
    {"epoch": 2, "lr": [0.05, 0.005], "train": {"loss": 1.5, "mae": 0.75}, "validation": None},
]


def read_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    acc = event_accumulator.EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_crc32c_matches_the_standard_check_value():
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0


def test_epoch_scalars_name_split_value_and_param_group():
    assert epoch_scalars(HISTORY[0]) == {
        "train/loss": 2.5,
        "train/mae": 1.25,
        "validation/loss": 3.0,
        "lr/group_0": 0.1,
        "lr/group_1": 0.01,
        "seconds/train": 2.5,  # the slowest rank's
        "seconds/data": 1.0,
        "seconds/compute": 1.0,
        "seconds/communication": 0.5,
    }


def test_tensorboard_reads_every_epoch_once_after_rewrites_and_a_resume(tmp_path):
    store = Store.create(str(tmp_path))
    first = TensorBoardLog(store, "r")
    first.write(HISTORY[:1])
    first.write(HISTORY[:1])  # rewritten, not appended
    TensorBoardLog(store, "r").write(HISTORY)  # a resumed task: the whole history again
    folder = Path(store.run("r").tensorboard)
    assert len(list(folder.iterdir())) == 1
    scalars = read_scalars(folder)
    assert scalars["train/loss"] == [(1, 2.5), (2, 1.5)]
    assert scalars["train/mae"] == [(1, 1.25), (2, 0.75)]
    assert scalars["validation/loss"] == [(1, 3.0)]
    assert [step for step, _ in scalars["lr/group_1"]] == [1, 2]
    assert scalars["lr/group_1"][1][1] == pytest.approx(0.005)


def window(loss: float, rows: int) -> torch.Tensor:
    return torch.tensor([loss * rows, float(rows)], dtype=torch.float64)


def train_steps(log: TensorBoardLog, drawn: int, until: int, losses=None) -> int:
    """Draw batches up to ``until``, adding a point wherever ``log.due``; returns ``until``."""
    for d in range(drawn + 1, until + 1):
        if log.due(d):
            loss = losses(d) if losses else 1.0 / d
            log.add_step(d, window(loss, 4), [0.1, 0.01])
    return until


def test_step_scalars_every_n_batches_and_the_epochs_ends(tmp_path):
    store = Store.create(str(tmp_path))
    log = TensorBoardLog(store, "r", every_steps=2)
    log.start([], 0, 0)
    train_steps(log, 0, 5)  # epoch 1: 5 batches
    log.write(HISTORY[:1], 5)
    train_steps(log, 5, 10)
    log.write(HISTORY, 10)
    scalars = read_scalars(store.run("r").tensorboard)
    assert scalars["step/train_loss"] == [(s, pytest.approx(1 / s)) for s in (2, 4, 6, 8, 10)]
    assert scalars["step/lr_group_1"] == [(s, pytest.approx(0.01)) for s in (2, 4, 6, 8, 10)]
    assert scalars["step/epoch"] == [(5, 1.0), (10, 2.0)]
    assert scalars["train/loss"] == [(1, 2.5), (2, 1.5)]  # per epoch, as without steps


def test_without_every_steps_the_file_holds_the_epochs_only(tmp_path):
    store = Store.create(str(tmp_path))
    log = TensorBoardLog(store, "r", every_steps=None)
    log.start([], 0, 0)
    assert not any(log.due(d) for d in range(1, 100))
    log.write(HISTORY, 10)
    assert set(read_scalars(store.run("r").tensorboard)) == set(epoch_scalars(HISTORY[0]))


def test_a_resumed_launch_drops_a_failed_attempts_later_steps_and_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(tensorboard, "STEP_FLUSH_S", 0.0)  # every point reaches the file
    store = Store.create(str(tmp_path))
    first = TensorBoardLog(store, "r", every_steps=2)
    first.start([], 0, 0)
    train_steps(first, 0, 5)
    first.write(HISTORY[:1], 5)
    train_steps(first, 5, 9, losses=lambda d: 99.0)  # epoch 2 fails after batch 9
    assert read_scalars(store.run("r").tensorboard)["step/train_loss"][-1] == (8, 99.0)

    resumed = TensorBoardLog(store, "r", every_steps=2)  # from epoch 1's checkpoint
    resumed.start(HISTORY[:1], 0, 5)
    train_steps(resumed, 5, 10)
    resumed.write(HISTORY, 10)
    scalars = read_scalars(store.run("r").tensorboard)
    assert scalars["step/train_loss"] == [(s, pytest.approx(1 / s)) for s in (2, 4, 6, 8, 10)]
    assert scalars["step/epoch"] == [(5, 1.0), (10, 2.0)]
    assert scalars["train/loss"] == [(1, 2.5), (2, 1.5)]


def test_a_mid_epoch_write_of_a_resumed_launch_keeps_the_epochs(tmp_path, monkeypatch):
    monkeypatch.setattr(tensorboard, "STEP_FLUSH_S", 0.0)
    store = Store.create(str(tmp_path))
    first = TensorBoardLog(store, "r", every_steps=2)
    first.start([], 0, 0)
    train_steps(first, 0, 5)
    first.write(HISTORY[:1], 5)
    # a commit 2 batches into epoch 2: the loop's count says 7 batches drawn
    resumed = TensorBoardLog(store, "r", every_steps=2)
    resumed.start(HISTORY[:1], 2, 7)
    train_steps(resumed, 7, 8)
    scalars = read_scalars(store.run("r").tensorboard)
    assert scalars["train/loss"] == [(1, 2.5)]
    assert [s for s, _ in scalars["step/train_loss"]] == [2, 4, 8]


def test_a_resized_launch_goes_on_from_the_last_epochs_end(tmp_path):
    """An elastic fit started again with more processes: the loop counts its batches drawn
    anew (epochs x the new, shorter epoch), the step axis goes on where epoch 1 ended."""
    store = Store.create(str(tmp_path))
    first = TensorBoardLog(store, "r", every_steps=2)
    first.start([], 0, 0)
    train_steps(first, 0, 6)
    first.write(HISTORY[:1], 6)
    resumed = TensorBoardLog(store, "r", every_steps=2)
    resumed.start(HISTORY[:1], 0, 3)  # 3 batches an epoch now
    assert not resumed.due(4) and resumed.due(5)  # step 8 of the axis
    train_steps(resumed, 3, 6)
    resumed.write(HISTORY, 6)
    scalars = read_scalars(store.run("r").tensorboard)
    assert [s for s, _ in scalars["step/train_loss"]] == [2, 4, 6, 8]
    assert scalars["step/epoch"] == [(6, 1.0), (9, 2.0)]


def test_a_file_that_cannot_be_read_back_is_written_anew(tmp_path, caplog):
    store = Store.create(str(tmp_path))
    log = TensorBoardLog(store, "r", every_steps=2)
    store.write_bytes(log.path, b"\x05\x00\x00\x00\x00\x00\x00\x00garbage")
    log.start(HISTORY[:1], 0, 5)
    assert "cannot be read back" in caplog.text
    train_steps(log, 5, 6)
    log.write(HISTORY, 6)
    assert [s for s, _ in read_scalars(store.run("r").tensorboard)["step/train_loss"]] == [6]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_window_on_the_gpu_is_written_once_copied(tmp_path):
    from spark_estimator.worker.loop.metrics import EpochSums

    store, device = Store.create(str(tmp_path)), torch.device("cuda")
    sums = EpochSums([], device)
    log = TensorBoardLog(store, "r", every_steps=2)
    log.start([], 0, 0)
    for drawn in range(1, 5):
        sums.add("train", torch.tensor(float(drawn), device=device), 2, [], drawn)
        if log.due(drawn):
            log.add_step(drawn, sums.take_window(), [0.1])
    log.write(HISTORY[:1], 4)
    scalars = read_scalars(store.run("r").tensorboard)
    assert scalars["step/train_loss"] == [(2, 1.5), (4, 3.5)]
