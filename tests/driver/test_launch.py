import os

import pytest

from spark_estimator.driver.launch import (
    available_slots,
    master_slots,
    run_barrier_job,
    scheduler_slots,
)


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
def test_slots_implied_by_the_master(master, cpus, slots):
    assert master_slots(FakeSpark(master, cpus)) == slots
    # where the scheduler cannot be asked (Spark Connect) the master's count is used
    assert scheduler_slots(FakeSpark(master, cpus)) is None
    assert available_slots(FakeSpark(master, cpus)) == slots


def test_real_session_slots_come_from_the_scheduler(spark):
    assert scheduler_slots(spark) == 4
    assert available_slots(spark, wanted=5) == 4  # local mode: no waiting for executors


def task():
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    peers = ctx.allGather(str(ctx.partitionId()))  # only possible if all run at once
    return {"rank": ctx.partitionId(), "peers": sorted(peers), "pid": os.getpid()}


def test_barrier_job_runs_all_tasks_together_and_sorts_by_rank(spark):
    summaries = run_barrier_job(spark, 3, task, "test barrier")
    assert [s["rank"] for s in summaries] == [0, 1, 2]
    assert all(s["peers"] == ["0", "1", "2"] for s in summaries)


def failing_once(marker):
    def task():
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        if ctx.partitionId() == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)  # the process dies: nothing raised
        return {"rank": ctx.partitionId(), "pid": os.getpid()}

    return task


def test_with_retry_spark_relaunches_all_tasks_after_one_died(spark, tmp_path):
    summaries = run_barrier_job(spark, 2, failing_once(str(tmp_path / "m")), "t", retry=True)
    assert [s["rank"] for s in summaries] == [0, 1]


def test_without_retry_the_job_fails(spark, tmp_path):
    with pytest.raises(Exception, match="barrier"):
        run_barrier_job(spark, 2, failing_once(str(tmp_path / "m")), "t")
