"""Two separate executor processes (local-cluster) train one model together."""

import os

import pytest
import torch

from spark_estimator import Store, TorchEstimator
from tests.conftest import regression_rows

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

    summary = store.read_json(store.join("runs", model.getRunId(), "ranks.json"))
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
