import threading

import pytest
import torch

from spark_estimator.serialization import (
    dumps,
    loads,
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
