"""FSDP's pieces in a real one-process gloo group (sharding over 2+ ranks: tests/test_fsdp.py)."""

import pytest
import torch

from spark_estimator.worker.comm import fsdp
from spark_estimator.worker.comm.rendezvous import RankInfo

ONE = RankInfo(0, 1, 0, 1, torch.device("cpu"))


def test_the_fitted_weights_are_gathered_when_they_fit_and_refused_when_they_do_not(
    process_group, monkeypatch
):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    want = {k: v.clone() for k, v in net.state_dict().items()}
    fsdp.shard_model(net, ONE, ("Linear",), "none")
    assert fsdp.local_elements(net) == 4 * 8 + 8 + 8 + 1
    got = fsdp.full_state_dict(net)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    monkeypatch.setattr(fsdp, "available_bytes", lambda: 100)
    with pytest.raises(MemoryError, match="fitted model's weights .* do not fit rank 0's"):
        fsdp.full_state_dict(net)


def test_a_unit_class_the_model_lacks_is_named(process_group):
    with pytest.raises(
        ValueError, match=r"fsdp_wrap: the model has no submodule of class \['Block'\]"
    ):
        fsdp.shard_model(torch.nn.Linear(2, 2), ONE, ("Block",), "none")


def test_mixed_precision_computes_in_bf16_and_returns_float32(process_group):
    net = fsdp.shard_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), ONE, (), "bf16")
    assert net(torch.ones(3, 2)).dtype == torch.float32
    assert fsdp.policy("bf16", root=False).param_dtype == torch.bfloat16
    assert fsdp.policy("bf16", root=False).reduce_dtype == torch.float32
