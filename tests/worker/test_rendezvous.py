import torch

from spark_estimator.worker.rendezvous import select_device, task_gpu_addresses


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
