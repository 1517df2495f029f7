import pytest
import torch

from spark_estimator.worker.rendezvous import (
    cuda_ordinal,
    current_rank_info,
    local_ranks,
    select_device,
    task_gpu_addresses,
)


class FakeResource:
    def __init__(self, addresses):
        self.addresses = addresses


def test_cpu_when_gpu_not_wanted():
    assert select_device(False, ["0"], True) == (torch.device("cpu"), None)


def test_uses_the_gpu_address_spark_assigned():
    device, reason = select_device(True, ["3"], cuda_available=True)
    assert device == torch.device("cuda", 3) and reason is None


def test_falls_back_to_cpu_without_an_assigned_gpu():
    device, reason = select_device(True, [], cuda_available=True)
    assert device.type == "cpu" and "assigned no GPU" in reason


def test_falls_back_to_cpu_without_cuda():
    device, reason = select_device(True, ["0"], cuda_available=False)
    assert device.type == "cpu" and "no CUDA" in reason


def test_task_gpu_addresses_reads_spark_resources():
    assert task_gpu_addresses({"gpu": FakeResource(["1", "2"])}) == ["1", "2"]
    assert task_gpu_addresses({}) == []


def test_spark_gpu_address_maps_to_the_visible_device_index():
    assert cuda_ordinal("3", None) == 3
    assert cuda_ordinal("3", "2,3") == 1  # CUDA_VISIBLE_DEVICES renumbers the GPUs
    assert cuda_ordinal("0", "") == 0
    device, _ = select_device(True, ["5"], True, visible_devices="4,5,6")
    assert device == torch.device("cuda", 1)


def test_local_rank_counts_tasks_on_the_same_host():
    hosts = ["a", "b", "a", "a", "b"]
    assert [local_ranks(hosts, r) for r in range(5)] == [(0, 3), (0, 2), (1, 3), (2, 3), (1, 2)]


def test_no_rank_info_outside_a_task():
    with pytest.raises(RuntimeError, match="not inside a spark-estimator task"):
        current_rank_info()
