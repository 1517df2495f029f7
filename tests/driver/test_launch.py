import os

import pytest

from spark_estimator.driver.launch import available_slots, run_barrier_job


class FakeConf:
    def __init__(self, cpus):
        self.cpus = cpus

    def get(self, key, default):
        return self.cpus if key == "spark.task.cpus" else default


class FakeSpark:
    def __init__(self, master, cpus="1", parallelism=8):
        self.sparkContext = type(
            "SC",
            (),
            {
                "master": master,
                "defaultParallelism": parallelism,
                "getConf": lambda s: FakeConf(cpus),
            },
        )()


@pytest.mark.parametrize(
    "master,cpus,slots",
    [
        ("local", "1", 1),
        ("local[4]", "1", 4),
        ("local[4]", "2", 2),
        ("local[3, 2]", "1", 3),
        ("local[*]", "1", os.cpu_count()),
        ("local-cluster[2,1,1024]", "1", 2),
        ("local-cluster[3, 4, 2048]", "2", 6),
        ("spark://host:7077", "2", 4),
    ],
)
def test_available_slots(master, cpus, slots):
    assert available_slots(FakeSpark(master, cpus)) == slots


def test_real_session_slots(spark):
    assert available_slots(spark) == 4


def task():
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    peers = ctx.allGather(str(ctx.partitionId()))  # only possible if all run at once
    return {"rank": ctx.partitionId(), "peers": sorted(peers), "pid": os.getpid()}


def test_barrier_job_runs_all_tasks_together_and_sorts_by_rank(spark):
    summaries = run_barrier_job(spark, 3, task, "test barrier")
    assert [s["rank"] for s in summaries] == [0, 1, 2]
    assert all(s["peers"] == ["0", "1", "2"] for s in summaries)
