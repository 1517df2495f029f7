"""Elastic fits on a real standalone cluster (tests/clusters.py) whose Workers die for good:
the fit shrinks, grows back at an epoch's end, or fails when too few slots remain; and the
same across hosts of their own (NetnsCluster), one of which is stopped."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from spark_estimator import Store, TorchEstimator, TrainingError
from spark_estimator.callbacks import Callback
from spark_estimator.driver.elastic import ElasticSize
from tests.clusters import NetnsCluster, StandaloneCluster
from tests.conftest import regression_rows
from tests.driver.test_launch import FakeConnectSession
from tests.faults import Fault

LOST = RuntimeError("Job aborted\nExecutorLostFailure (executor 2 exited) Reason: worker lost")


def test_a_lost_launch_starts_again_with_the_slots_there_are_between_min_and_max():
    spark = FakeConnectSession(spark_master="local[2]")  # 2 slots, by its configuration
    size = ElasticSize(spark, 4, 1, 4, max_restarts=2, timeout_s=5)
    assert size.after_loss(LOST, resumed_epoch=3) == 2
    [resize] = size.resizes
    assert (resize.from_procs, resize.to_procs, resize.resumed_epoch) == (4, 2, 3)
    assert (
        resize.why == "lost processes: ExecutorLostFailure (executor 2 exited) Reason: worker lost"
    )
    assert size.after_loss(LOST, resumed_epoch=4) == 2 and len(size.resizes) == 1  # same size
    with pytest.raises(RuntimeError, match="lost processes 3 times, more than max_restarts=2"):
        size.after_loss(LOST)


def test_too_few_slots_fail_after_the_timeout_with_what_was_seen():
    spark = FakeConnectSession(spark_master="local[1]")
    size = ElasticSize(spark, 4, 2, 4, max_restarts=3, timeout_s=0.2)
    with pytest.raises(
        RuntimeError,
        match=r"min_num_proc: the cluster offered fewer than 2 "
        r"task slots for elastic_timeout=0.2 s .*slots seen since then: 1 at 0 s",
    ):
        size.after_loss(LOST)
    fixed = ElasticSize(spark, 2, None, 2, max_restarts=3, timeout_s=0.2)
    with pytest.raises(RuntimeError, match="num_proc: the cluster offered fewer than 2"):
        fixed.after_loss(LOST)


def test_slots_that_cannot_be_counted_keep_the_size():
    spark = FakeConnectSession(spark_master="yarn")  # Spark Connect, no count in its conf
    size = ElasticSize(spark, 4, 2, 3, max_restarts=3, timeout_s=0.2)
    assert size.after_loss(LOST) == 3 and size.grow_to() is None


ROWS = 300
LR = 0.02


@pytest.fixture(scope="module")
def cluster():
    with StandaloneCluster(workers=3) as started:
        yield started


@pytest.fixture
def three_workers(cluster):
    """The module's cluster with 3 live Workers (a test before may have lost one)."""
    while len(cluster.alive_workers()) < 3:
        cluster.start_worker()
    cluster.wait_workers(3)
    spark = cluster.session()
    deadline = time.monotonic() + 120
    while spark.sparkContext._jsc.sc().getExecutorIds().size() < 3:
        assert time.monotonic() < deadline, "the executors did not register"
        time.sleep(0.2)
    return cluster, spark


class EpochRecordingNet(torch.nn.Module):
    """Linear; each training forward appends its row ids to ``<epoch>-<world>-<pid>.txt``."""

    def __init__(self, out_dir: str):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 1)
        self.out_dir, self.epoch, self.world = out_dir, None, None

    def forward(self, x, row_id):
        if self.training and self.epoch is not None:
            name = f"{self.epoch}-{self.world}-{os.getpid()}.txt"
            with open(os.path.join(self.out_dir, name), "a") as f:
                f.write(" ".join(str(int(i)) for i in row_id.tolist()) + "\n")
        return self.lin(x)


class TellEpoch(Callback):
    def on_epoch_begin(self, epoch, state):
        state.model.epoch, state.model.world = epoch, state.world_size


class WaitForGrowth(Callback):
    """At the end of ``epoch`` on fewer than ``procs`` processes, wait (at most 3 minutes)
    until the driver has asked the ranks to grow, so the test does not race the cluster."""

    def __init__(self, grow_file: str, epoch: int, procs: int):
        self.grow_file, self.epoch, self.procs = grow_file, epoch, procs

    def on_epoch_end(self, epoch, logs, state):
        if epoch == self.epoch and state.world_size < self.procs:
            deadline = time.monotonic() + 180
            while not os.path.exists(self.grow_file) and time.monotonic() < deadline:
                time.sleep(0.2)


def estimator(store, net, run_id, callbacks=(), **params):
    return TorchEstimator(
        model=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=LR),
        loss=torch.nn.MSELoss(),
        feature_cols=["x", "id"],
        label_cols=["y"],
        batch_size=10,
        epochs=6,
        num_proc=3,
        lr_scaling="linear",
        store=store,
        use_gpu=False,
        verbose=False,
        run_id=run_id,
        callbacks=[TellEpoch(), *callbacks],
        **params,
    )


def rows_per_epoch(out_dir: Path, history: list[dict], committed: dict) -> dict[int, list[int]]:
    """Each finished epoch's row ids: from the launch that finished it (its size), and for
    an epoch in ``committed`` ({epoch: (size, steps)}), the first ``steps`` batches of the
    launch of that size which committed them before it lost a process."""
    seen: dict[int, list[int]] = {}
    for record in history:
        epoch, world = record["epoch"], record["num_proc"]
        for path in out_dir.glob(f"{epoch}-{world}-*.txt"):
            seen.setdefault(epoch, []).extend(int(v) for v in path.read_text().split())
        if epoch in committed:
            size, steps = committed[epoch]
            for path in out_dir.glob(f"{epoch}-{size}-*.txt"):
                batches = path.read_text().splitlines()[:steps]
                seen[epoch].extend(int(v) for line in batches for v in line.split())
    return seen


def final_loss(model, df) -> float:
    out = model.transform(df).select("y", "prediction").toPandas()
    return float(((out["y"] - out["prediction"]) ** 2).mean())


def namespace_of(pid: int) -> str:
    """The named network namespace (``ip netns``) process ``pid`` runs in."""
    out = subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True)
    return out.stdout.strip()


@pytest.mark.cluster
def test_a_fit_across_hosts_loses_a_host_shrinks_and_grows_back_on_a_new_one(tmp_path, caplog):
    """Runs first in this module: the module's standalone cluster is not started yet."""
    caplog.set_level(logging.INFO, logger="spark_estimator.driver.training_job")
    with NetnsCluster(workers=3) as cluster:
        spark = cluster.session()
        store = Store.create(str(tmp_path / "store"))  # one filesystem: every host sees it
        df = spark.createDataFrame(regression_rows(ROWS), "x array<double>, y double, id long")
        seen, hung = tmp_path / "seen", tmp_path / "hung"
        seen.mkdir()
        # rank 1 stops in epoch 2 (the others wait in its allreduce); then its host is stopped
        fault = Fault("hang", rank=1, epoch=2, marker=hung, after_batches=3)
        est = estimator(
            store,
            EpochRecordingNet(str(seen)),
            "across-hosts",
            callbacks=[fault, WaitForGrowth(store.run("across-hosts").grow, epoch=3, procs=3)],
            min_num_proc=2,
            commit_every_steps=2,
        )
        at: dict[str, float] = {}

        def operator():  # stops the hung rank's host, then adds a host once 2 train
            while not (hung.exists() and hung.read_text().endswith("\n")):  # written whole
                time.sleep(0.05)
            pid = int(hung.read_text().split()[-1])
            ns = namespace_of(pid)
            at["stop"] = time.time()
            cluster.stop_worker(int(ns.removeprefix(cluster.ns_prefix)))
            while not list(seen.glob("2-2-*.txt")):
                time.sleep(0.05)
            at["training on 2"] = time.time()
            cluster.start_worker()
            at["host started"] = time.time()
            while not list(seen.glob("4-3-*.txt")):
                time.sleep(0.05)
            at["training on 3"] = time.time()

        helper = threading.Thread(target=operator, daemon=True)
        started = time.monotonic()
        helper.start()
        model = est.fit(df)
        helper.join(60)
        took = time.monotonic() - started
        for record in caplog.records:
            if "lost processes" in record.getMessage():  # one per restart
                at[f"job failed #{sum(k.startswith('job') for k in at) + 1}"] = record.created
            if "slots returned" in record.getMessage():
                at.setdefault("grow", record.created)
        times = ", ".join(
            f"{k} +{v - at['stop']:.1f} s" for k, v in sorted(at.items(), key=lambda kv: kv[1])
        )
        print(f"\nnetns elastic fit: {took:.1f} s; after the host stop: {times}")

        assert [k for k in at if k.startswith("job failed")] == ["job failed #1"]  # one loss
        history = model.getHistory()
        assert [h["epoch"] for h in history] == [1, 2, 3, 4, 5, 6]
        assert [h["num_proc"] for h in history] == [3, 2, 2, 3, 3, 3]
        resizes = model.getTrainingSummary()["resizes"]
        assert [(r["from_procs"], r["to_procs"]) for r in resizes] == [(3, 2), (2, 3)]
        assert resizes[0]["why"].startswith("lost processes") and resizes[0]["resumed_epoch"] == 1
        assert resizes[1]["why"] == "slots returned" and resizes[1]["resumed_epoch"] == 3
        # 10 batches an epoch on 3 processes, a commit every 2: the fault came in batch 3,
        # after the commit of step 2
        for epoch, ids in rows_per_epoch(seen, history, {2: (3, 2)}).items():
            assert sorted(ids) == list(range(ROWS)), f"epoch {epoch}"
        # no clean run to compare with (to save its time): the standalone test below has one
        assert final_loss(model, df) < 0.05
        # the last launch: one rank on each of 3 hosts (the new one among them), over gloo
        ranks = store.read_json(store.run("across-hosts").ranks)
        assert [r["gradient_path"] for r in ranks] == ["gloo"] * 3
        assert [r["local_rank"] for r in ranks] == [0, 0, 0]
        spaces = {namespace_of(r["pid"]) for r in ranks}
        assert spaces <= set(cluster.namespaces()) and len(spaces) == 3
        assert f"{cluster.ns_prefix}3" in spaces


@pytest.mark.cluster
def test_a_fit_that_loses_a_worker_for_good_shrinks_and_grows_back(three_workers, tmp_path):
    cluster, spark = three_workers
    store = Store.create(str(tmp_path / "store"))
    df = spark.createDataFrame(regression_rows(ROWS), "x array<double>, y double, id long")
    clean = estimator(store, EpochRecordingNet(str(tmp_path)), "clean").fit(df)

    seen = tmp_path / "seen"
    seen.mkdir()
    grow_file = store.run("elastic").grow  # a local store: a path of this filesystem
    fault = Fault("kill-worker", rank=1, epoch=2, marker=tmp_path / "killed", after_batches=3)
    est = estimator(
        store,
        EpochRecordingNet(str(seen)),
        "elastic",
        callbacks=[fault, WaitForGrowth(grow_file, epoch=3, procs=3)],
        min_num_proc=2,
        commit_every_steps=2,
    )
    started = time.monotonic()
    killed = []

    def bring_a_worker_back():  # once the fit runs on 2 processes, as an operator would
        while not (tmp_path / "killed").exists():
            time.sleep(0.1)
        killed.append(time.monotonic() - started)
        while not list(seen.glob("2-2-*.txt")):
            time.sleep(0.1)
        killed.append(time.monotonic() - started)
        cluster.start_worker()

    helper = threading.Thread(target=bring_a_worker_back, daemon=True)
    helper.start()
    model = est.fit(df)
    helper.join(60)
    print(
        f"elastic fit: {time.monotonic() - started:.1f} s; kill at {killed[0]:.1f} s, "
        f"training again on 2 processes at {killed[1]:.1f} s"
    )

    history = model.getHistory()
    assert [h["epoch"] for h in history] == [1, 2, 3, 4, 5, 6]
    assert [h["num_proc"] for h in history] == [3, 2, 2, 3, 3, 3]
    # lr_scaling="linear": the rate follows the number of processes
    assert [h["lr"][0] for h in history] == pytest.approx([LR * h["num_proc"] for h in history])
    resizes = model.getTrainingSummary()["resizes"]
    assert [(r["from_procs"], r["to_procs"]) for r in resizes] == [(3, 2), (2, 3)]
    assert resizes[0]["why"].startswith("lost processes") and resizes[0]["resumed_epoch"] == 1
    assert resizes[1]["why"] == "slots returned" and resizes[1]["resumed_epoch"] == 3
    print("resizes:", resizes)
    # each finished epoch saw every row exactly once, whatever its number of processes
    # 10 batches an epoch on 3 processes, a commit every 2: the kill came in batch 3, after
    # the commit of step 2, whose rows the 2 processes did not train on again
    for epoch, ids in rows_per_epoch(seen, history, {2: (3, 2)}).items():
        assert sorted(ids) == list(range(ROWS)), f"epoch {epoch}"
    # as good as the run that lost nothing (same data; its own sizes, so not bitwise)
    assert final_loss(model, df) == pytest.approx(final_loss(clean, df), abs=0.01)
    assert final_loss(model, df) < 0.05


@pytest.mark.cluster
def test_too_few_slots_after_a_loss_fail_the_fit_within_elastic_timeout(three_workers, tmp_path):
    _, spark = three_workers
    store = Store.create(str(tmp_path / "store"))
    df = spark.createDataFrame(regression_rows(ROWS), "x array<double>, y double, id long")
    fault = Fault("kill-worker", rank=2, epoch=2, marker=tmp_path / "killed")
    est = estimator(
        store,
        EpochRecordingNet(str(tmp_path)),
        "too-few",
        callbacks=[fault],
        min_num_proc=3,
        elastic_timeout=5.0,
    )
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"fewer than 3 task slots for elastic_timeout=5 s") as e:
        est.fit(df)
    assert "slots seen since then: 2 at 0 s" in str(e.value)
    assert time.monotonic() - started < 120
    assert store.checkpoint_epochs("too-few") == [1]  # kept for a later fit to resume


@pytest.mark.cluster
def test_a_lightning_fit_that_loses_a_worker_for_good_goes_on_with_fewer(three_workers, tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from spark_estimator import LightningEstimator

    marker = str(tmp_path / "killed")

    class Linear(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(3, 1)

        def forward(self, x):
            return self.lin(x)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self(batch["x"]).squeeze(1), batch["y"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class KillWorkerAt(pl.Callback):  # rank 1's Worker, after batch 3 of epoch 2, once
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            at = (trainer.global_rank, trainer.current_epoch + 1, batch_idx + 1)
            if at == (1, 2, 3) and not os.path.exists(marker):
                Fault("kill-worker", 1, 2, marker).fire(2)

    _, spark = three_workers
    store = Store.create(str(tmp_path / "store"))
    df = spark.createDataFrame(regression_rows(ROWS), "x array<double>, y double, id long")
    model = LightningEstimator(
        model=Linear(),
        feature_cols=["x"],
        label_cols=["y"],
        batch_size=10,
        epochs=4,
        num_proc=3,
        min_num_proc=2,
        store=store,
        use_gpu=False,
        verbose=False,
        callbacks=[KillWorkerAt()],
    ).fit(df)
    assert os.path.exists(marker)
    history = model.getHistory()
    assert [h["epoch"] for h in history] == [1, 2, 3, 4]
    assert [h["num_proc"] for h in history] == [3, 2, 2, 2]  # Lightning fits only shrink
    [resize] = model.getTrainingSummary()["resizes"]
    assert (resize["from_procs"], resize["to_procs"], resize["resumed_epoch"]) == (3, 2, 1)
    assert history[-1]["train"]["loss"] < history[0]["train"]["loss"]


@pytest.mark.cluster
def test_an_error_of_the_training_code_still_fails_an_elastic_fit_at_once(three_workers, tmp_path):
    _, spark = three_workers
    store = Store.create(str(tmp_path / "store"))
    df = spark.createDataFrame(regression_rows(ROWS), "x array<double>, y double, id long")
    fault = Fault("raise", rank=1, epoch=2, marker=tmp_path / "m", once=False)
    est = estimator(
        store, EpochRecordingNet(str(tmp_path)), "bug", callbacks=[fault], min_num_proc=2
    )
    started = time.monotonic()
    with pytest.raises(TrainingError, match="injected fault on rank 1 at epoch 2"):
        est.fit(df)
    assert time.monotonic() - started < 60  # not started again


@pytest.mark.cluster
def test_an_fsdp_fit_that_loses_a_worker_for_good_resumes_its_shards_on_fewer(
    three_workers, tmp_path
):
    """Sharded state written by 3 ranks (a commit inside epoch 2) read by 2: DCP re-shards."""
    _, spark = three_workers
    store = Store.create(str(tmp_path / "store"))
    df = spark.createDataFrame(regression_rows(ROWS), "x array<double>, y double, id long")

    def build():
        with torch.device("meta"):
            return torch.nn.Sequential(
                torch.nn.Linear(3, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
            )

    fault = Fault("kill-worker", rank=1, epoch=2, marker=tmp_path / "killed", after_batches=3)
    model = TorchEstimator(
        model=build,
        optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=0.02),
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["y"],
        batch_size=10,
        epochs=4,
        num_proc=3,
        min_num_proc=2,
        commit_every_steps=2,
        parallelism="fsdp",
        fsdp_wrap=["Linear"],
        store=store,
        use_gpu=False,
        verbose=False,
        callbacks=[fault],
    ).fit(df)
    assert (tmp_path / "killed").exists()
    history = model.getHistory()
    assert [h["num_proc"] for h in history] == [3, 2, 2, 2]
    [resize] = model.getTrainingSummary()["resizes"]
    assert (resize["from_procs"], resize["to_procs"], resize["resumed_epoch"]) == (3, 2, 1)
    # 10 batches an epoch on 3 ranks, a commit every 2: killed in batch 3, after step 2
    assert model.getTrainingSummary()["resumed_from_commit"] == {"epoch": 2, "step": 2}
    held = [r["parameter_elements"] for r in model.getTrainingSummary()["rank_memory"]]
    assert len(held) == 2 and sum(held) == 3 * 32 + 32 + 32 + 1
    assert history[-1]["train"]["loss"] < history[0]["train"]["loss"] / 2
