"""A rank's Lightning Trainer (``task_trainer``) between real processes (spawned, a real gloo
group) on an uneven split: each kind of logged value as Lightning's callbacks read it
(``trainer.callback_metrics``) and as our history records it."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch
import torch.distributed as dist

from spark_estimator.store import Store
from spark_estimator.worker.comm.ranks import RankInfo
from spark_estimator.worker.lightning.hooks import lightning_parts
from spark_estimator.worker.lightning.train import _Batches, task_trainer

pl = pytest.importorskip("lightning.pytorch")
torchmetrics = pytest.importorskip("torchmetrics")

# the rows of each rank's batches: 13 + 12 validation rows, 11 + 10 training rows
VALIDATION = [[4, 3, 3, 3], [3, 3, 3, 3]]
TRAINING = [[4, 4, 3], [4, 3, 3]]


def row_values(first: int, count: int) -> list[float]:
    """A value per row that varies from row to row."""
    return [i / 4 + (i * 37 % 17) / 10 for i in range(first, first + count)]


def rank_rows(sizes: list[list[int]], rank: int, first: int = 0) -> list[float]:
    """The values of ``rank``'s rows: the ranks' rows one after the other from ``first``."""
    return row_values(first + sum(map(sum, sizes[:rank])), sum(sizes[rank]))


def batches(sizes: list[list[int]], rank: int, first: int = 0) -> _Batches:
    """``rank``'s batches as the Trainer gets them (dicts column -> tensor)."""
    values, out = rank_rows(sizes, rank, first), []
    for size in sizes[rank]:
        y = torch.tensor(values[:size])
        values = values[size:]
        out.append({"x": torch.stack([y, torch.ones_like(y)], 1), "y": y})
    draw = lambda: ((batch, None) for batch in out)  # noqa: E731
    return _Batches(len(out), draw, lambda batch, epoch, decoded: batch, None)


class LogsEveryKind(pl.LightningModule):
    """Logs its batches' row values with each reduction, with and without sync_dist."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(2, 1)
        self.rows_mean = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        y = batch["y"]
        self.log("train_mean", y.mean(), batch_size=len(y), on_step=True, on_epoch=True)
        return torch.nn.functional.mse_loss(self.net(batch["x"]).squeeze(1), y)

    def validation_step(self, batch, batch_idx):
        y, rows = batch["y"], len(batch["y"])
        self.log("mean", y.mean(), batch_size=rows)
        self.log("mean_sync", y.mean(), batch_size=rows, sync_dist=True)
        self.log("mean_implicit", y.mean())  # the batch size taken from the batch
        self.log("sum", y.sum(), reduce_fx="sum")
        self.log("sum_sync", y.sum(), reduce_fx="sum", sync_dist=True)
        self.log("max", y.max(), reduce_fx="max")
        self.log("max_sync", y.max(), reduce_fx="max", sync_dist=True)
        self.log("min_sync", y.min(), reduce_fx="min", sync_dist=True)
        self.rows_mean.update(y)
        self.log("metric", self.rows_mean)
        if self.global_rank == 0:
            self.log("rank0", y.mean(), batch_size=rows, rank_zero_only=True)

    def on_validation_epoch_end(self):
        self.log("per_rank", float(self.global_rank + 1))  # once per rank and epoch

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Seen(pl.Callback):
    """What Lightning's callbacks read at each epoch's end (``trainer.callback_metrics``)."""

    def __init__(self):
        self.validation: list[dict] = []
        self.training: list[dict] = []

    @staticmethod
    def _read(trainer) -> dict:
        return {name: float(value) for name, value in trainer.callback_metrics.items()}

    def on_validation_end(self, trainer, pl_module):
        read = self._read(trainer)  # also holds the training values of the last step
        self.validation.append({k: v for k, v in read.items() if not k.startswith("train_")})

    def on_train_epoch_end(self, trainer, pl_module):
        self.training.append(self._read(trainer))


def _fit(rank: int, world: int, folder: str) -> None:
    torch.set_num_threads(1)
    pg = dist.FileStore(os.path.join(folder, "pg-store"), world)
    dist.init_process_group("gloo", store=pg, rank=rank, world_size=world)
    store = Store.create(os.path.join(folder, "store"))
    recorder = lightning_parts(pl)[2](store, "r", seed=0, keep=None, report=None)
    seen = Seen()
    info = RankInfo(rank, world, local_rank=0, local_size=1, device=torch.device("cpu"))
    trainer = task_trainer(pl, info, store, "r", 2, [seen, recorder], {"logger": False})
    train, validation = batches(TRAINING, rank, 100), batches(VALIDATION, rank)
    trainer.fit(LogsEveryKind(), train, validation)
    seen = {"validation": seen.validation, "training": seen.training}
    torch.save({"seen": seen, "history": recorder.history}, os.path.join(folder, f"{rank}.pt"))
    dist.destroy_process_group()


def fit_on_ranks(folder) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_fit, args=(r, 2, str(folder))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    return [torch.load(folder / f"{r}.pt") for r in range(2)]


def near(value: float):
    """``value`` as float32 arithmetic reaches it."""
    return pytest.approx(value, rel=1e-6)


def test_each_kind_of_logged_value_as_callbacks_read_it_and_the_history_records_it(tmp_path):
    ranks = fit_on_ranks(tmp_path)
    ys = [rank_rows(VALIDATION, r) for r in range(2)]
    every = ys[0] + ys[1]
    train = rank_rows(TRAINING, 0, 100) + rank_rows(TRAINING, 1, 100)
    mean = near(sum(every) / 25)
    # per rank: what Lightning computes, which its callbacks monitor on that rank
    expected = [
        {
            "mean": mean,  # the exact mean over all rows, synced or not
            "mean_sync": mean,
            "mean_implicit": mean,
            "metric": mean,  # a torchmetrics Metric: its own compute, over all ranks
            "per_rank": 1.5,  # logged once per rank: each rank counts once
            "sum": near(sum(ys[rank])),  # not synced: the rank's own
            "sum_sync": near(sum(every)),
            "max": near(max(ys[rank])),
            "max_sync": near(max(every)),
            "min_sync": near(min(every)),
            **({"rank0": near(sum(ys[0]) / 13)} if rank == 0 else {}),
        }
        for rank in range(2)
    ]
    # the ranks' own means, and the mean of the two, are not the exact one
    assert sum(ys[0]) / 13 != mean and (sum(ys[0]) / 13 + sum(ys[1]) / 12) / 2 != mean
    for rank, result in enumerate(ranks):
        assert result["seen"]["validation"] == [expected[rank]] * 2
        assert [read["train_mean"] for read in result["seen"]["training"]] == [
            near(sum(train) / 21)
        ] * 2
    # the history: values every rank holds as they are, the others' mean over ranks
    history = ranks[0]["history"]
    assert history == ranks[1]["history"] and len(history) == 2
    for record in history:
        assert record["train"]["train_mean"] == near(sum(train) / 21)
        assert record["validation"] == {
            **expected[1],
            "sum": near((sum(ys[0]) + sum(ys[1])) / 2),
            "max": near((max(ys[0]) + max(ys[1])) / 2),
            "rank0": expected[0]["rank0"],
        }
