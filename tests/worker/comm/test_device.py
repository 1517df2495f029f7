import os

import pytest
import torch

from spark_estimator import run
from spark_estimator.worker.comm import device
from spark_estimator.worker.comm.device import (
    THREAD_VARIABLES,
    cuda_ordinal,
    select_device,
    task_device,
    task_gpu_addresses,
    thread_environment,
)


class FakeResource:
    def __init__(self, addresses):
        self.addresses = addresses


def test_cpu_when_gpu_not_wanted():
    assert select_device(False, ["0"], True) == (torch.device("cpu"), None)


def test_uses_the_gpu_address_spark_assigned():
    device, reason = select_device(True, ["3"], cuda_available=True)
    assert device == torch.device("cuda", 3) and reason is None


def test_auto_without_gpus_configured_is_the_cpu_silently():
    # the driver tells the tasks use_gpu=False when the cluster has no GPUs configured
    assert select_device(False, [], cuda_available=False) == (torch.device("cpu"), None)


def test_auto_uses_the_assigned_gpu():
    assert select_device("auto", ["2"], cuda_available=True) == (torch.device("cuda", 2), None)


def test_auto_falls_back_to_cpu_with_a_reason_where_a_task_got_no_gpu():
    device, reason = select_device("auto", [], cuda_available=True)
    assert device.type == "cpu" and "GPUs are configured" in reason and "got none" in reason


def test_auto_falls_back_to_cpu_with_a_reason_without_cuda():
    device, reason = select_device("auto", ["0"], cuda_available=False)
    assert device.type == "cpu" and "no CUDA" in reason


def test_use_gpu_true_requires_an_assigned_gpu():
    with pytest.raises(RuntimeError, match=r"use_gpu: True .*Spark assigned no GPU to this task"):
        select_device(True, [], cuda_available=True)


def test_use_gpu_true_requires_cuda():
    with pytest.raises(RuntimeError, match=r"use_gpu: True .*GPU 0.* torch has no CUDA"):
        select_device(True, ["0"], cuda_available=False)


def test_task_gpu_addresses_reads_spark_resources():
    assert task_gpu_addresses({"gpu": FakeResource(["1", "2"])}) == ["1", "2"]
    assert task_gpu_addresses({}) == []


def test_spark_gpu_address_maps_to_the_visible_device_index():
    assert cuda_ordinal("3", None) == 3
    assert cuda_ordinal("3", "2,3") == 1  # CUDA_VISIBLE_DEVICES renumbers the GPUs
    assert cuda_ordinal("0", "") == 0
    device, _ = select_device(True, ["5"], True, visible_devices="4,5,6")
    assert device == torch.device("cuda", 1)


def test_thread_variables_are_the_task_cpus_where_the_user_set_none():
    assert thread_environment(4, {}, {}) == {
        "OMP_NUM_THREADS": "4",
        "MKL_NUM_THREADS": "4",
        "RAYON_NUM_THREADS": "4",
    }
    assert thread_environment(0, {}, {})["RAYON_NUM_THREADS"] == "1"


def test_a_value_the_user_or_spark_set_wins():
    # spark.executorEnv.RAYON_NUM_THREADS (or the executor's environment); Spark's own
    # OMP_NUM_THREADS, which every Python worker has unless executorEnv sets it
    environ = {"RAYON_NUM_THREADS": "6", "OMP_NUM_THREADS": "2"}
    assert thread_environment(4, environ, {}) == {"MKL_NUM_THREADS": "4"}


def test_a_value_an_earlier_task_of_the_python_worker_set_is_set_again():
    earlier = {"RAYON_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    environ = {**earlier, "OMP_NUM_THREADS": "8"}
    assert thread_environment(8, environ, earlier) == {
        "MKL_NUM_THREADS": "8",
        "RAYON_NUM_THREADS": "8",
    }
    # one the task's own code changed since is no longer ours
    assert thread_environment(8, {**environ, "MKL_NUM_THREADS": "3"}, earlier) == {
        "RAYON_NUM_THREADS": "8"
    }


class FakeTask:
    def __init__(self, cpus: int):
        self._cpus = cpus

    def cpus(self) -> int:
        return self._cpus

    def resources(self) -> dict:
        return {}

    def partitionId(self) -> int:
        return 0


@pytest.fixture
def fresh_environment(monkeypatch):
    """No thread variables in the environment, none set by an earlier task; the variables
    and torch's thread count put back afterwards (a Spark session started later would pass
    what leaked on to its Python workers)."""
    before = {name: os.environ.pop(name, None) for name in THREAD_VARIABLES}
    monkeypatch.setattr(device, "_set_here", {})
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    for name, value in before.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value


def test_task_device_sets_them_for_each_task_of_a_reused_python_worker(
    fresh_environment, monkeypatch
):
    monkeypatch.setenv("MKL_NUM_THREADS", "5")  # the user's
    assert task_device(FakeTask(2), use_gpu=False) == (torch.device("cpu"), None)
    assert torch.get_num_threads() == 2
    assert [os.environ[n] for n in THREAD_VARIABLES] == ["2", "5", "2"]
    task_device(FakeTask(3), use_gpu=False)  # the next task, in the same process
    assert [os.environ[n] for n in THREAD_VARIABLES] == ["3", "5", "3"]
    assert torch.get_num_threads() == 3


def report_threads():
    """What a rank of run() sees."""
    return {name: os.environ.get(name) for name in THREAD_VARIABLES}, torch.get_num_threads()


def test_the_ranks_of_a_real_job_see_the_task_cpus_and_run_env_wins(spark):
    # local[4]: a task has spark.task.cpus = 1 CPU
    (seen, threads), *_ = run(
        report_threads, num_proc=1, use_gpu=False, env={"MKL_NUM_THREADS": "3"}, spark=spark
    )
    assert seen == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "3", "RAYON_NUM_THREADS": "1"}
    assert threads == 1
