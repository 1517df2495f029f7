import os
import time

import pytest

from spark_estimator import Store
from spark_estimator.driver import launch as launch_module
from spark_estimator.driver import monitor as monitor_module
from spark_estimator.driver.launch import (
    QUIET_LOGGERS,
    available_slots,
    cancel_jobs,
    connect_slots,
    is_connect,
    job_tag,
    labelled_jobs,
    master_slots,
    quiet_task_errors,
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


def test_a_lost_task_fails_the_whole_job(spark, tmp_path):
    with pytest.raises(Exception, match="barrier"):
        run_barrier_job(spark, 2, failing_once(str(tmp_path / "m")), "t")


def recorded_then_stuck(store):
    def task():
        from pyspark import BarrierTaskContext

        from spark_estimator.shared.failures import record_failure

        if BarrierTaskContext.get().partitionId() == 0:
            error = ValueError("the training code failed")
            record_failure(store.run("r").failure("L"), store, 0, error)
        time.sleep(600)  # no task fails: Spark has no reason to end the job

    return task


def test_a_job_that_outlives_its_recorded_failure_is_cancelled(spark, tmp_path, monkeypatch):
    monkeypatch.setattr(monitor_module, "FAILED_JOB_GRACE_S", 2.0)
    store = Store.create(str(tmp_path / "store"))
    tag = f"spark-estimator-{os.getpid()}-cancel"
    cancel = monitor_module.FitMonitor(
        store, "r", "L", verbose=False, cancel=lambda: cancel_jobs(spark, tag)
    )
    started = time.monotonic()
    with pytest.raises(Exception, match="cancel"), cancel:
        run_barrier_job(spark, 2, recorded_then_stuck(store), "stuck", tag=tag)
    assert time.monotonic() - started < 60


class FakeConnectConf:
    def __init__(self, values):
        self.values = values

    def get(self, key, default=None):
        return self.values.get(key, default)


class FakeConnectSession:
    """What launch.py reads of a Spark Connect session: its conf and job tags."""

    def __init__(self, **conf):
        self.conf = FakeConnectConf({k.replace("_", "."): v for k, v in conf.items()})
        self.tags: list[str] = []

    def addTag(self, tag):
        self.tags.append(tag)

    def removeTag(self, tag):
        self.tags.remove(tag)


FakeConnectSession.__module__ = "pyspark.sql.connect.session"  # how is_connect tells


@pytest.mark.parametrize(
    "conf,slots",
    [
        ({"spark_master": "local[2]"}, 2),
        ({"spark_master": "local[4]", "spark_task_cpus": "2"}, 2),
        ({"spark_master": "local"}, 1),
        ({"spark_master": "local[*]"}, os.cpu_count()),
        ({"spark_master": "local-cluster[2,3,1024]"}, 6),
        ({"spark_master": "spark://h:7077", "spark_default_parallelism": "8"}, 8),
        (
            {
                "spark_master": "yarn",
                "spark_executor_instances": "3",
                "spark_executor_cores": "4",
                "spark_task_cpus": "2",
            },
            6,
        ),
    ],
)
def test_connect_slots_come_from_the_servers_conf(conf, slots):
    spark = FakeConnectSession(**conf)
    assert connect_slots(spark) == slots
    assert scheduler_slots(spark) is None
    assert available_slots(spark) == slots
    assert available_slots(spark, wanted=1) == slots  # known: wanted does not change it


@pytest.mark.parametrize(
    "conf",
    [
        {"spark_master": "local-cluster[3,8,1024]"},
        {"spark_master": "yarn", "spark_executor_instances": "3", "spark_executor_cores": "8"},
    ],
)
def test_under_a_task_profile_of_an_executors_cores_each_executor_is_one_slot(conf):
    from pyspark.resource import TaskResourceRequest

    class Profile:  # what the slot count reads of a pyspark ResourceProfile
        taskResources = {"cpus": TaskResourceRequest("cpus", 8)}

    spark = FakeConnectSession(**conf)
    assert connect_slots(spark) == 24
    assert connect_slots(spark, Profile()) == 3
    assert available_slots(spark, profile=Profile()) == 3


def test_connect_slots_unknown_trust_num_proc_or_ask_for_it():
    spark = FakeConnectSession(spark_master="yarn", spark_executor_cores="4")
    assert connect_slots(spark) is None
    assert available_slots(spark, wanted=3) == 3  # Spark refuses a too large barrier stage
    with pytest.raises(ValueError, match="num_proc: the task slots of this Spark Connect"):
        available_slots(spark)


def test_connect_jobs_are_tagged_not_described():
    spark = FakeConnectSession(spark_master="local[2]")
    with labelled_jobs(spark, "spark-estimator run a,b"):
        assert spark.tags == ["spark-estimator run a;b"]  # tags may not hold commas
    assert spark.tags == []
    with pytest.raises(RuntimeError), labelled_jobs(spark, "x"):
        raise RuntimeError("the job failed")
    assert spark.tags == []  # removed after a failure too
    assert job_tag("") == "spark-estimator"


def test_classic_sessions_are_not_connect(spark):
    assert not is_connect(spark)
    assert is_connect(FakeConnectSession())


def test_sparks_task_loggers_are_off_while_a_training_job_runs_and_theirs_again_after(spark):
    log4j = spark.sparkContext._jvm.org.apache.logging.log4j

    def levels():
        return {str(log4j.LogManager.getLogger(name).getLevel()) for name in QUIET_LOGGERS}

    pending = launch_module._Quiet.timer  # an earlier failed job's loggers, not back yet
    if pending is not None:
        pending.join()
    before = levels()
    with quiet_task_errors(spark):
        with quiet_task_errors(spark):  # another thread's job at the same time
            assert levels() == {"OFF"}
        assert levels() == {"OFF"}  # the other job still runs
    assert levels() == before
    # no level of their own is left behind: they follow the root level as before
    spark.sparkContext.setLogLevel("INFO")
    try:
        assert levels() == {"INFO"}
    finally:
        spark.sparkContext.setLogLevel("ERROR")  # the tests' sessions' level (conftest)


def test_after_a_failed_job_sparks_task_loggers_stay_off_while_its_tasks_are_killed(
    spark, monkeypatch
):
    monkeypatch.setattr(launch_module, "QUIET_AFTER_FAILURE_S", 1.0)
    log4j = spark.sparkContext._jvm.org.apache.logging.log4j

    def levels():
        return {str(log4j.LogManager.getLogger(name).getLevel()) for name in QUIET_LOGGERS}

    before = levels()
    with pytest.raises(ValueError), quiet_task_errors(spark):
        raise ValueError("the job failed")
    assert levels() == {"OFF"}  # Spark logs the killing of the other tasks after the failure
    time.sleep(2.0)
    assert levels() == before
