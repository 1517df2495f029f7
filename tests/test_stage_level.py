"""Stage-level scheduling on a real standalone cluster (tests/clusters.py): two Workers of 2
cores and one fake GPU each (addresses "0" and "1", from their discovery scripts), executors
of 2 cores and 1 GPU, and ``spark.task.resource.gpu.amount=0.5``, so an executor runs two
ordinary tasks at once, each with a half share of its GPU.

What Spark did is read back from its own record, the application UI's REST API: each stage's
resource profile and its tasks' executors, launch times and durations. With the profile
(the default), the materialization's tasks still run two per executor, while the training
job, transform and ``run(fn)`` run one task per executor with 2 cores and the executor's
GPU address to itself (no CUDA here: each rank falls back to the CPU with that address
recorded); ``stage_level_scheduling=False`` keeps today's two tasks per executor, each with
a share of the GPU address."""

from __future__ import annotations

import json
import time
import urllib.request
from datetime import datetime

import pytest
import torch

from spark_estimator import Store, TorchModel, run
from spark_estimator.driver import launch
from spark_estimator.driver.launch import takes_profile
from spark_estimator.driver.stage_profile import task_profile
from tests.clusters import StandaloneCluster
from tests.conftest import linear_net, make_estimator, regression_rows

pytestmark = pytest.mark.cluster

GPU_CONF = {
    "spark.executor.cores": "2",
    "spark.executor.resource.gpu.amount": "1",
    "spark.task.resource.gpu.amount": "0.5",
    "spark.ui.enabled": "true",  # its REST API is the record read here
    "spark.ui.port": "0",
    "spark.locality.wait": "0",  # tasks go to any free slot at once, not their data's executor
}
SLACK_S = 0.1  # see at_once
ALONE = {"0": 1, "1": 1}  # executor -> most tasks of a stage running on it at once
SHARED = {"0": 2, "1": 2}


@pytest.fixture(scope="module")
def gpu_cluster():
    with StandaloneCluster(workers=2, cores=2, gpus=True) as cluster:
        yield cluster.session(**GPU_CONF)


class SparkRecord:
    """The application's stages and tasks as its UI's REST API reports them."""

    def __init__(self, spark):
        self.sc = spark.sparkContext
        self.api = f"{self.sc.uiWebUrl}/api/v1/applications/{self.sc.applicationId}"
        self.seen = {s["stageId"] for s in self._stages()}

    def _get(self, path: str):
        with urllib.request.urlopen(f"{self.api}/{path}", timeout=30) as response:
            return json.load(response)

    def _stages(self) -> list[dict]:
        self.sc._jsc.sc().listenerBus().waitUntilEmpty()  # the UI's store is up to date
        return self._get("stages")

    def new_stages(self) -> list[dict]:
        """The stages run since this record began, oldest first, each with its tasks."""
        stages = [s for s in self._stages() if s["stageId"] not in self.seen]
        for stage in stages:
            path = f"stages/{stage['stageId']}/{stage['attemptId']}/taskList?length=1000"
            stage["tasks"] = self._get(path)
        return sorted(stages, key=lambda s: s["stageId"])


def _seconds(launch: str) -> float:
    return datetime.strptime(launch, "%Y-%m-%dT%H:%M:%S.%f%Z").timestamp()


def at_once(stage: dict) -> dict[str, int]:
    """Per executor, the most of the stage's tasks that ran on it at the same time, each
    from its launch to its end as the driver recorded them, less ``SLACK_S``: the driver
    launches the next task into a slot as soon as the executor frees it, and records the
    end of the task before it some milliseconds later. A task counts itself however short
    (a run() task on a warm Python worker can take less than ``SLACK_S``)."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for task in stage["tasks"]:
        start = _seconds(task["launchTime"])
        end = start + task["duration"] / 1e3 - SLACK_S
        spans.setdefault(task["executorId"], []).append((start, end))
    return {
        executor: max(
            1 + sum(s <= start < e for j, (s, e) in enumerate(runs) if j != i)
            for i, (start, _) in enumerate(runs)
        )
        for executor, runs in spans.items()
    }


def training_stage(stages: list[dict]) -> dict:
    """The barrier job's stage (a fit's, "spark-estimator run-<id>", or run()'s)."""
    [stage] = [s for s in stages if (s.get("description") or "").startswith("spark-estimator run")]
    return stage


@pytest.fixture
def df(gpu_cluster):
    rows = regression_rows(64)
    return gpu_cluster.createDataFrame(rows, "x array<double>, y double, id long").repartition(4)


def fit(df, tmp_path, **params):
    est = make_estimator(
        linear_net(), Store.create(str(tmp_path / "store")), num_proc=None, use_gpu="auto"
    )
    est.setParams(epochs=1, partitions_per_process=2, **params)
    with pytest.warns(RuntimeWarning, match="but torch has no CUDA support here"):
        return est, est.fit(df)


def test_the_training_job_alone_runs_one_rank_per_executor_with_its_gpu(gpu_cluster, df, tmp_path):
    record = SparkRecord(gpu_cluster)
    est, model = fit(df, tmp_path)
    stages = record.new_stages()
    train = training_stage(stages)
    assert train["resourceProfileId"] != 0 and at_once(train) == ALONE
    # the session's one profile, made once for all its jobs
    assert task_profile(gpu_cluster, True).profile.id == train["resourceProfileId"]
    etl = [s for s in stages if s is not train and s["numTasks"] > 1]  # the materialization's
    assert {s["resourceProfileId"] for s in etl} == {0}
    assert max(n for s in etl for n in at_once(s).values()) == 2  # 2 tasks per executor
    summary = model.getTrainingSummary()
    assert summary["world_size"] == 2  # GPU slots: one per executor, not its 2 cores
    assert summary["task_resources"] == {
        "stage_level_scheduling": True,
        "task_cpus": 2,
        "task_gpus": 1.0,
        "reason": None,
    }
    ranks = est.getStore().read_json(est.getStore().run(model.getRunId()).ranks)
    assert sorted(a for r in ranks for a in r["gpu_addresses"]) == ["0", "1"]
    assert {r["device"] for r in ranks} == {"cpu"}
    assert {r["device_note"] for r in ranks} == {
        f"Spark assigned GPU {r['gpu_addresses'][0]}, but torch has no CUDA support here; "
        "training on CPU"
        for r in ranks
    }
    devices = summary["rank_devices"]
    assert [(d["rank"], d["gpu_addresses"]) for d in devices] == [
        (r["rank"], r["gpu_addresses"]) for r in ranks
    ]


def test_switched_off_the_training_job_shares_the_gpus_as_before(gpu_cluster, df, tmp_path):
    record = SparkRecord(gpu_cluster)
    est, model = fit(df, tmp_path, stage_level_scheduling=False)
    train = training_stage(record.new_stages())
    assert train["resourceProfileId"] == 0 and at_once(train) == SHARED
    summary = model.getTrainingSummary()
    assert summary["world_size"] == 4  # 2 cores x 2 executors, half a GPU each
    assert summary["task_resources"] == {
        "stage_level_scheduling": False,
        "task_cpus": 1,
        "task_gpus": 0.5,
        "reason": "switched off by stage_level_scheduling=False",
    }
    ranks = est.getStore().read_json(est.getStore().run(model.getRunId()).ranks)
    assert sorted(a for r in ranks for a in r["gpu_addresses"]) == ["0", "0", "1", "1"]


def test_more_processes_than_gpu_slots_fail_before_any_job_naming_them(
    gpu_cluster, df, tmp_path, monkeypatch
):
    monkeypatch.setattr(launch, "SLOT_WAIT_S", 1.0)  # the slots for 3 are not coming
    record = SparkRecord(gpu_cluster)
    est = make_estimator(linear_net(), Store.create(str(tmp_path)), num_proc=3, use_gpu="auto")
    with pytest.raises(ValueError, match=r"num_proc: 3 training processes .* only 2 GPU slots"):
        est.fit(df)
    assert record.new_stages() == []


class TaskResources(torch.nn.Module):
    """Returns, per row, the GPU address Spark assigned the task (-1: none) and its cpus,
    after a moment, so that a stage's tasks overlap where they may."""

    def forward(self, x):
        from pyspark import TaskContext

        ctx = TaskContext.get()
        gpu = ctx.resources().get("gpu")
        time.sleep(0.3)
        rows = x.shape[0]
        address = float(gpu.addresses[0]) if gpu else -1.0
        return torch.full((rows,), address), torch.full((rows,), float(ctx.cpus()))


@pytest.mark.parametrize("on", [True, False])
def test_transform_runs_one_model_per_gpu(gpu_cluster, df, on):
    record = SparkRecord(gpu_cluster)
    model = TorchModel(
        model=TaskResources(),
        feature_cols=["x"],
        output_cols=["gpu", "cpus"],
        output_shapes=[[], []],
        stage_level_scheduling=on,
    )
    rows = model.transform(df.repartition(8)).select("gpu", "cpus").collect()
    [stage] = [s for s in record.new_stages() if s["numTasks"] == 8]
    on = on and takes_profile()  # pyspark 3.5's mapInArrow takes none: transform as before
    assert (stage["resourceProfileId"] != 0, at_once(stage)) == (on, ALONE if on else SHARED)
    cpus = 2.0 if on else 1.0
    assert sorted({(r.gpu, r.cpus) for r in rows}) == [(0.0, cpus), (1.0, cpus)]


def task_resources():
    from pyspark import TaskContext

    from spark_estimator import distributed as sd

    ctx = TaskContext.get()
    return {"gpu": list(ctx.resources()["gpu"].addresses), "cpus": ctx.cpus(), "rank": sd.rank()}


@pytest.mark.parametrize(
    "on, spread, ranks",
    [
        # on pyspark 3.5 too (./dev.sh test-legacy): the barrier job as an RDD withResources
        pytest.param(True, ALONE, 2, marks=pytest.mark.legacy),
        (False, SHARED, 4),
    ],
)
def test_run_gives_each_rank_its_executors_gpu(gpu_cluster, on, spread, ranks):
    record = SparkRecord(gpu_cluster)
    with pytest.warns(RuntimeWarning, match="no CUDA support here"):
        got = run(task_resources, spark=gpu_cluster, stage_level_scheduling=on)
    stage = training_stage(record.new_stages())
    assert (stage["resourceProfileId"] != 0, at_once(stage)) == (on, spread)
    assert [r["rank"] for r in got] == list(range(ranks))
    assert sorted(a for r in got for a in r["gpu"]) == sorted(["0", "1"] * (ranks // 2))
    assert {r["cpus"] for r in got} == {2 if on else 1}
