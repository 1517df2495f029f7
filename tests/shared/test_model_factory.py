import pytest
import torch

from spark_estimator.shared import model_factory


class Scaled(torch.nn.Module):
    """Holds a parameter of its own but has no reset_parameters."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        self.scale = torch.nn.Parameter(torch.ones(3))


def test_a_function_builds_a_module_and_anything_else_is_named():
    assert model_factory.is_factory(lambda: None) and not model_factory.is_factory(Scaled())
    assert isinstance(model_factory.build(Scaled), Scaled)
    with pytest.raises(
        TypeError, match="model: the function must return a torch.nn.Module, got int"
    ):
        model_factory.build(lambda: 3)


def test_meta_parameters_get_memory_and_their_modules_initial_values():
    with torch.device("meta"):
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    assert model_factory.on_meta(net)
    torch.manual_seed(0)
    model_factory.materialize(net, torch.device("cpu"))
    assert not model_factory.on_meta(net)
    assert torch.equal(net[1].weight, torch.ones(8))  # BatchNorm's reset_parameters
    assert torch.equal(net[1].running_var, torch.ones(8))  # and its buffers
    assert 0 < net[0].weight.abs().max() <= 0.5  # Linear's: uniform(-1/sqrt(4), 1/sqrt(4))


def test_a_module_without_reset_parameters_is_refused_naming_its_tensors():
    with torch.device("meta"):
        net = torch.nn.Sequential(Scaled())
    with pytest.raises(
        ValueError, match=r"model: \['0.scale'\] were built on the meta device.*Scaled"
    ):
        model_factory.materialize(net, torch.device("cpu"))
