import math

import torch
import torch.distributed as dist

from spark_estimator.worker.loop.metrics import EpochSums


def test_sums_are_row_weighted_and_reduced_in_one_collective(process_group, monkeypatch):
    calls = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: calls.append(1) or real(t))
    sums = EpochSums(["mae"], torch.device("cpu"))
    for step, (loss, mae, rows) in enumerate([(1.0, 2.0, 10), (4.0, 1.0, 30), (9.0, 9.0, 0)]):
        sums.add("train", torch.tensor(loss), rows, [torch.tensor(mae, dtype=torch.float64)])
        sums.check_finite(torch.tensor(loss), step + 1)
    sums.add("validation", torch.tensor(0.5), 4, [torch.tensor(0.25, dtype=torch.float64)])
    sums.reduce()
    assert len(calls) == 1
    assert sums.record("train") == {"loss": (10 + 120) / 40, "mae": (20 + 30) / 40}
    assert sums.record("validation") == {"loss": 0.5, "mae": 0.25}
    assert sums.non_finite_steps == 0


def test_non_finite_losses_are_counted_with_the_first_step():
    sums = EpochSums([], torch.device("cpu"))
    for step, loss in enumerate([1.0, math.nan, 2.0, math.inf], start=1):
        sums.check_finite(torch.tensor(loss), step)
    assert int(sums.sums[-1]) == 2 and int(sums.first_bad_step) == 2


def test_a_split_without_rows_has_no_record():
    assert EpochSums([], torch.device("cpu")).record("validation") is None
