import math

import torch
import torch.distributed as dist

from spark_estimator.worker.loop import metrics
from spark_estimator.worker.loop.metrics import EpochSums

TIMES = {"train": 2.0, "data": 0.5, "compute": 1.25, "communication": 0.25}


def test_sums_are_row_weighted_and_reduced_in_one_collective(process_group, monkeypatch):
    calls = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: calls.append(1) or real(t))
    sums = EpochSums(["mae"], torch.device("cpu"))
    for step, (loss, mae, rows) in enumerate([(1.0, 2.0, 10), (4.0, 1.0, 30), (9.0, 9.0, 0)]):
        mae = torch.tensor(mae, dtype=torch.float64)
        sums.add("train", torch.tensor(loss), rows, [mae], step + 1)
    sums.add("validation", torch.tensor(0.5), 4, [torch.tensor(0.25, dtype=torch.float64)])
    sums.reduce(0, TIMES)
    assert len(calls) == 1
    assert sums.record("train") == {"loss": (10 + 120) / 40, "mae": (20 + 30) / 40}
    assert sums.record("validation") == {"loss": 0.5, "mae": 0.25}
    assert sums.non_finite_steps == 0 and sums.first_bad_step is None
    assert sums.times() == {k: [v] for k, v in TIMES.items()}


def test_steps_are_folded_into_the_sums_in_groups_and_before_a_reading(process_group):
    sums = EpochSums([], torch.device("cpu"))
    steps = metrics.FOLD + 3
    for step in range(1, steps + 1):
        sums.add("train", torch.tensor(float(step)), 2, [], step)
    # one fold after FOLD steps: the sums hold those, the last 3 wait in the list
    assert sums.sums[1].item() == 2 * metrics.FOLD and len(sums.pending["train"]) == 3
    assert sums.running_loss("train") == sum(range(1, steps + 1)) / steps
    sums.reduce(0, TIMES)
    assert sums.record("train") == {"loss": sum(range(1, steps + 1)) / steps}


def test_non_finite_losses_are_counted_with_the_first_step(process_group):
    sums = EpochSums([], torch.device("cpu"))
    for step, loss in enumerate([1.0, math.nan, 2.0, math.inf], start=1):
        sums.add("train", torch.tensor(loss), 4, [], step)
    sums.add("validation", torch.tensor(math.nan), 4, [])  # validation losses are not checked
    sums.reduce(0, TIMES)
    assert sums.non_finite_steps == 2 and sums.first_bad_step == 2


def test_a_split_without_rows_has_no_record(process_group):
    sums = EpochSums([], torch.device("cpu"))
    sums.reduce(0, TIMES)
    assert sums.record("validation") is None


def test_a_window_holds_the_training_batches_since_it_was_last_taken(process_group):
    sums = EpochSums([], torch.device("cpu"))
    sums.resume([5.0, 5.0] + [0.0] * 3, None)  # a commit's sums: not in any window
    for loss, rows in [(1.0, 2), (4.0, 2)]:
        sums.add("train", torch.tensor(loss), rows, [], 1)
    sums.add("validation", torch.tensor(7.0), 3, [])  # validation is not in it
    assert sums.take_window().tolist() == [10.0, 4.0]
    sums.add("train", torch.tensor(3.0), 1, [], 3)
    assert sums.take_window().tolist() == [3.0, 1.0]
    assert sums.take_window().tolist() == [0.0, 0.0]
    assert sums.running_loss("train") == (5 + 10 + 3) / (5 + 4 + 1)  # the epoch's, unchanged
