import pickle
import threading

import pytest
import torch

from spark_estimator import Store
from spark_estimator.shared.serialization import (
    dumps,
    dumps_for_saving,
    loads,
    loads_saved,
    state_dict_digest,
    state_from_bytes,
    state_to_bytes,
)


def test_model_and_optimizer_pickled_together_stay_bound():
    net = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net2, opt2 = loads(dumps((net, opt), "optimizer"))
    assert {id(p) for p in opt2.param_groups[0]["params"]} == {id(p) for p in net2.parameters()}


def test_unpicklable_object_names_the_parameter():
    with pytest.raises(TypeError, match="^loss: cannot be serialized"):
        dumps(threading.Lock(), "loss")


def test_state_round_trip_is_weights_only_loadable():
    state = {"model": {"w": torch.ones(2)}, "history": [{"epoch": 1}]}
    back = state_from_bytes(state_to_bytes(state), weights_only=True)
    assert torch.equal(back["model"]["w"], torch.ones(2)) and back["history"] == [{"epoch": 1}]


def test_digest_tells_equal_from_different_weights():
    a = torch.nn.Linear(2, 2).state_dict()
    b = {k: v.clone() for k, v in a.items()}
    assert state_dict_digest(a) == state_dict_digest(b)
    b["weight"][0, 0] += 1e-6
    assert state_dict_digest(a) != state_dict_digest(b)


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
        self.b.weight = self.a.weight
        self.frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
        self.register_buffer("steps", torch.tensor(5))
        self.register_buffer("scratch", torch.ones(2), persistent=False)


def test_saving_moves_weights_out_of_the_pickle_and_back():
    net = Tied()
    data, weights = dumps_for_saving({"model": net}, "TorchModel", net.state_dict(keep_vars=True))
    assert net.a.weight.detach().numpy().tobytes() not in data
    assert set(state_from_bytes(weights)) == {
        "a.weight",
        "a.bias",
        "b.weight",
        "b.bias",
        "frozen",
        "steps",
    }
    back = loads_saved(data, weights)["model"]
    assert back.b.weight is back.a.weight and isinstance(back.a.weight, torch.nn.Parameter)
    assert not back.frozen.requires_grad and back.a.weight.requires_grad
    assert torch.equal(back.a.weight, net.a.weight) and int(back.steps) == 5
    assert torch.equal(back.scratch, torch.ones(2))  # not in the state dict: pickled inline
    x = torch.randn(4, 3)
    assert torch.equal(back.b(x), net.b(x))


def test_saving_without_weights_is_one_plain_pickle():
    data, weights = dumps_for_saving({"model": torch.nn.Linear(2, 1)}, "TorchEstimator")
    assert weights is None and isinstance(loads(data)["model"], torch.nn.Linear)
    with pytest.raises(TypeError, match="^TorchEstimator: cannot be serialized"):
        dumps_for_saving(threading.Lock(), "TorchEstimator")


def test_saving_drops_store_and_filesystem_credentials(tmp_path):
    options = {"secret": "not-to-be-saved"}
    store = Store(str(tmp_path), storage_options=options)
    data, _ = dumps_for_saving({"store": store, "fs": store.fs}, "TorchEstimator")
    assert b"not-to-be-saved" not in data
    back = loads_saved(data)
    assert back["store"].url == store.url and back["store"].storage_options == {}
    assert back["fs"].storage_options == {}
    assert pickle.loads(pickle.dumps(store)).storage_options == options  # to the executors
