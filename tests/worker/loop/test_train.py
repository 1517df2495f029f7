"""The training loop in this process (a real one-process gloo group, real Parquet)."""

import cloudpickle
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from spark_estimator.shared.spec import ColumnSpec, DatasetInfo, LoaderSpec, LoopSpec, TrainSpec
from spark_estimator.worker.comm.ranks import RankInfo
from spark_estimator.worker.loop import train as train_module
from spark_estimator.worker.loop.metrics import EpochSums
from spark_estimator.worker.loop.step import Stepper

# what makes the host wait for the device on a GPU (torch.cuda.set_sync_debug_mode's kind)
SYNCING = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")


def regression_spec(
    root, store, rows=96, batch=8, epochs=2, loop: LoopSpec | None = None, **loader
) -> TrainSpec:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 4, generator=generator)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1
    (root / "train").mkdir(parents=True)
    table = pa.table({"x": pa.array(x.tolist(), pa.list_(pa.float32())), "y": y.numpy()})
    pq.write_table(table, root / "train" / "part-0.parquet", row_group_size=32)
    row_groups = [min(32, rows - start) for start in range(0, rows, 32)]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    bundle = {
        "model": net,
        # SGD: Adam keeps its step count in a host tensor it reads every step (not a sync)
        "optimizer": torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9),
        "loss": torch.nn.MSELoss(),
    }
    data = DatasetInfo(
        path=str(root),
        features=[ColumnSpec("x", "array", "float32")],
        labels=[ColumnSpec("y", "scalar", "float32")],
        files={"train": [("train/part-0.parquet", row_groups)]},
        row_lengths={"x": 4},
    )
    return TrainSpec(
        cloudpickle.dumps(bundle),
        data,
        store,
        "r",
        batch,
        epochs,
        0,
        False,
        None,
        loader=LoaderSpec(**loader),
        loop=loop or LoopSpec(),
    )


@pytest.mark.parametrize("fraction", [0.5, 0.0])
def test_no_step_after_an_epochs_first_makes_the_host_wait_for_the_device(
    tmp_path, store, process_group, monkeypatch, fraction
):
    """Counted on the CPU: every call that would synchronise with a GPU, from the end of an
    epoch's first step to its one reduction, for data held on the device and streamed
    (progress reports, at most one every few seconds on rank 0, are left out: report=None)."""
    counting, calls = [False], []
    for name in SYNCING:
        real = getattr(torch.Tensor, name)

        def counted(tensor, *args, _real=real, _name=name, **kwargs):
            if counting[0]:
                calls.append(_name)
            return _real(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    step, reduce = Stepper.__call__, EpochSums.reduce

    def stepped(self, *args):
        result = step(self, *args)
        counting[0] = True
        return result

    def reduced(self, *args):
        counting[0] = False
        return reduce(self, *args)

    monkeypatch.setattr(Stepper, "__call__", stepped)
    monkeypatch.setattr(EpochSums, "reduce", reduced)
    spec = regression_spec(tmp_path, store, device_cache_fraction=fraction)
    summary = train_module.train(spec, RankInfo(0, 1, 0, 1, torch.device("cpu")))
    assert summary.batches_per_epoch == [12, 12]
    assert summary.data_placement.startswith("held" if fraction else "streaming")
    assert calls == []
