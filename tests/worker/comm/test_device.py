import pytest
import torch

from spark_estimator.worker.comm.device import cuda_ordinal, select_device, task_gpu_addresses


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
