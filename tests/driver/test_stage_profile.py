"""When the training job (and transform) runs with a task resource profile of one GPU and an
executor's cores (driver/stage_profile.py): the decision from the cluster's settings, the
reason where it does not apply, logged once per session; the profile's slots in num_proc's
error. The profile at work on a real standalone cluster: tests/test_stage_level.py."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from spark_estimator.driver import stage_profile, validate
from spark_estimator.driver.stage_profile import ClusterFacts, TaskProfile, decide, task_profile

GPU_CLUSTER = ClusterFacts(
    version="4.1.0",
    master="spark://host:7077",
    local=False,
    connect=False,
    takes_profile=True,
    executor_gpus=1.0,
    task_gpus=0.5,
    executor_cores=2,
    task_cpus=1,
    dynamic_allocation=False,
)


def facts(**changes) -> ClusterFacts:
    return dataclasses.replace(GPU_CLUSTER, **changes)


@pytest.mark.parametrize(
    "changes",
    [
        {},  # the cluster: fractional task GPUs for the ETL
        {"task_gpus": 0.0},  # no task GPU amount: the profile still gives training a GPU
        {"master": "local-cluster[2,2,1024]"},
        {"master": "yarn", "version": "3.5.1"},
        {"master": "k8s://https://api:6443", "version": "4.0.0"},
        {"version": "3.4.0"},  # standalone from 3.4
        {"executor_cores": 16, "task_gpus": 1 / 16},
        {"takes_profile": False},  # pyspark 3.5: the barrier job as an RDD with resources
    ],
)
def test_training_asks_one_gpu_and_the_executors_cores_where_spark_can(changes):
    cluster = facts(**changes)
    assert decide(cluster, True, "auto", "training") == (cluster.executor_cores, None)
    assert decide(cluster, True, True, "training") == (cluster.executor_cores, None)


@pytest.mark.parametrize(
    "changes, enabled, use_gpu, job, reason",
    [
        ({}, False, "auto", "training", "stage_level_scheduling=False"),
        ({}, True, False, "training", "use_gpu=False"),
        ({"task_gpus": 1.0}, True, "auto", "training", "each task already gets a whole GPU"),
        ({"master": "local[4]", "local": True}, True, "auto", "training", "a local master"),
        ({"version": "3.3.2"}, True, "auto", "training", "Spark 3.3.2 has no task resource"),
        ({"master": "yarn", "version": "3.5.0"}, True, "auto", "training", "from Spark 3.5.1"),
        ({"master": "mesos://m:5050"}, True, "auto", "training", "the master 'mesos://m:5050'"),
        ({"connect": True, "takes_profile": False}, True, "auto", "training", "pyspark 4.0"),
        ({"takes_profile": False}, True, "auto", "transform", "pyspark 4.0"),
        ({"dynamic_allocation": True}, True, "auto", "transform", "dynamicAllocation"),
        ({"executor_gpus": 4.0}, True, "auto", "training", "executors have 4 GPUs"),
        ({"executor_cores": None}, True, "auto", "training", "spark.executor.cores is not set"),
        ({"executor_cores": 1}, True, "auto", "training", "already gets its executor's GPU"),
        ({"executor_cores": 1, "task_gpus": 0.0}, True, "auto", "training", "gpu.amount=1"),
    ],
)
def test_where_it_does_not_apply_the_reason_says_why(changes, enabled, use_gpu, job, reason):
    cpus, why = decide(facts(**changes), enabled, use_gpu, job)
    assert cpus is None and reason in why


def test_a_cluster_without_gpus_needs_no_profile_nor_a_reason():
    assert decide(facts(executor_gpus=0.0, task_gpus=0.0), True, "auto", "training") == (
        None,
        None,
    )


def test_a_local_session_keeps_the_default_and_logs_why_once(spark, caplog, monkeypatch):
    conf = {"spark.executor.resource.gpu.amount": "1", "spark.task.resource.gpu.amount": "0.5"}
    real = stage_profile._conf

    def with_gpus(session, key):
        return conf.get(key) or real(session, key)

    monkeypatch.setattr(stage_profile, "_conf", with_gpus)
    monkeypatch.setattr(stage_profile, "_logged", set())
    with caplog.at_level(logging.INFO, logger=stage_profile.__name__):
        first = task_profile(spark, True, "auto", "training")
        again = task_profile(spark, True, "auto", "training")
    assert first == again
    assert first.profile is None and first.cpus == 1 and first.gpus == 0.5
    assert "a local master" in first.reason
    lines = [r.getMessage() for r in caplog.records if r.name == stage_profile.__name__]
    assert lines == [f"stage-level scheduling does not apply to training here: {first.reason}"]
    assert first.summary() == {
        "stage_level_scheduling": False,
        "task_cpus": 1,
        "task_gpus": 0.5,
        "reason": first.reason,
    }


def test_a_cpu_session_logs_nothing(spark, caplog):
    with caplog.at_level(logging.DEBUG, logger=stage_profile.__name__):
        chosen = task_profile(spark, True, "auto", "training")
    assert chosen == TaskProfile(None, 1, 0.0, None)
    assert not [r for r in caplog.records if r.name == stage_profile.__name__]


GPU_SLOTS = TaskProfile(profile=object(), cpus=2, gpus=1.0, reason=None)


def test_num_proc_beyond_the_gpu_slots_names_them_and_why():
    with pytest.raises(ValueError) as error:
        validate.check_num_proc(3, 2, "start_timeout=30 s", slots_of=GPU_SLOTS.slots_note())
    message = str(error.value)
    assert message.startswith(
        "num_proc: 3 training processes requested but the cluster has only 2 GPU slots "
        "(counted within start_timeout=30 s): under stage-level scheduling each training "
        "process takes an executor's GPU and all its 2 cores (stage_level_scheduling=True)"
    )
    assert "set stage_level_scheduling=False" in message


def test_min_num_proc_beyond_the_gpu_slots_names_it():
    with pytest.raises(ValueError, match="min_num_proc: 3 training processes .* 2 GPU slots"):
        validate.check_min_num_proc(3, 4, 2, slots_of=GPU_SLOTS.slots_note())


def test_use_gpu_true_is_met_by_the_profile_without_a_task_gpu_amount():
    conf = {"spark.executor.resource.gpu.amount": "1"}.get
    assert validate.tasks_use_gpu(True, conf, GPU_SLOTS) is True


def test_use_gpu_true_without_a_task_gpu_says_why_the_profile_does_not_help():
    conf = {"spark.executor.resource.gpu.amount": "1"}.get
    local = TaskProfile(None, 1, 0.0, "the master 'local[4]' is a local master")
    with pytest.raises(ValueError, match=r"use_gpu: True .* does not apply here: the master"):
        validate.tasks_use_gpu(True, conf, local)
