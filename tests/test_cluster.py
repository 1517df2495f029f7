"""Separate executor processes (local-cluster): training together, surviving a killed rank."""

import os
import time

import pytest
import torch

from spark_estimator import Store, TorchEstimator
from spark_estimator.driver import launch
from tests.conftest import regression_rows
from tests.faults import Fault
from tests.test_reliability import assert_same_training, momentum_estimator

pytestmark = pytest.mark.cluster


class RecordingNet(torch.nn.Module):
    """A linear model that appends the row ids of each training batch to a file per process."""

    def __init__(self, out_dir):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)
        self.out_dir = out_dir

    def forward(self, x, row_id):
        if self.training:
            with open(os.path.join(self.out_dir, f"{os.getpid()}.txt"), "a") as f:
                f.write(" ".join(str(int(i)) for i in row_id.tolist()) + "\n")
        return self.lin(x)


def test_two_executor_processes_see_disjoint_rows_and_end_with_identical_weights(
    cluster_spark, tmp_path
):
    seen_dir = tmp_path / "seen"
    seen_dir.mkdir()
    torch.manual_seed(0)
    net = RecordingNet(str(seen_dir))
    store = Store.create(str(tmp_path / "store"))
    df = cluster_spark.createDataFrame(regression_rows(), "x array<double>, y double, id long")
    est = TorchEstimator(
        model=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
        loss=torch.nn.MSELoss(),
        feature_cols=["x", "id"],
        label_cols=["y"],
        batch_size=10,
        epochs=2,
        num_proc=2,
        store=store,
        use_gpu=False,
    )
    model = est.fit(df)

    summary = store.read_json(store.run(model.getRunId()).ranks)
    pids = {s["pid"] for s in summary}
    assert len(pids) == 2 and os.getpid() not in pids
    assert len({s["weights_digest"] for s in summary}) == 1

    seen = {}
    for path in seen_dir.iterdir():
        ids = [int(v) for line in path.read_text().split("\n") for v in line.split()]
        seen[int(path.stem)] = ids
    assert set(seen) == pids
    first, second = (set(ids) for ids in seen.values())
    assert not first & second
    assert first | second == set(range(200))
    assert all(len(ids) == 2 * len(set(ids)) for ids in seen.values())  # once per epoch
    assert model.getHistory()[-1]["train"]["loss"] < model.getHistory()[0]["train"]["loss"]


@pytest.mark.parametrize("action", ["kill", "kill-executor"])
def test_a_killed_rank_is_started_again_and_training_resumes_exactly(
    cluster_spark, tmp_path, action
):
    """Fault injection in the middle of epoch 3: rank 1's Python process is SIGKILLed, or
    the executor JVM running it is (Spark then starts a new executor)."""
    store = Store.create(str(tmp_path / "store"))
    df = cluster_spark.createDataFrame(regression_rows(), "x array<double>, y double, id long")
    clean = momentum_estimator(store, validation=0.25).fit(df)

    marker = tmp_path / "killed"
    fault = Fault(action, rank=1, epoch=3, marker=marker, after_batches=2)
    started = time.monotonic()
    resumed = momentum_estimator(store, validation=0.25, callbacks=[fault]).fit(df)
    print(f"{action}: the fit with the fault took {time.monotonic() - started:.1f} s")

    assert marker.read_text().startswith(f"{action} rank 1 epoch 3")
    assert resumed.getTrainingSummary()["resumed_from_epoch"] == 2
    assert_same_training(resumed, clean)
    pids = {s["pid"] for s in store.read_json(store.run(resumed.getRunId()).ranks)}
    assert int(marker.read_text().split()[-1]) not in pids  # the killed process was replaced


def test_too_few_slots_on_a_cluster_is_a_clear_error_in_bounded_time(
    cluster_spark, tmp_path, monkeypatch
):
    monkeypatch.setattr(launch, "SLOT_WAIT_S", 2.0)
    store = Store.create(str(tmp_path / "store"))
    df = cluster_spark.createDataFrame(regression_rows(), "x array<double>, y double, id long")
    started = time.monotonic()
    with pytest.raises(
        ValueError,
        match="num_proc: 3 training processes requested but the "
        "cluster can run only 2 tasks at once",
    ):
        momentum_estimator(store, num_proc=3).fit(df)
    assert time.monotonic() - started < 15
