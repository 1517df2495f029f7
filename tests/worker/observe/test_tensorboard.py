"""TensorBoardLog: event files TensorBoard's own reader reads back, one per run."""

from pathlib import Path

import pytest

from spark_estimator import Store
from spark_estimator.shared.history import epoch_scalars
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
