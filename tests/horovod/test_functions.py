"""broadcast_parameters and broadcast_optimizer_state across two real ranks."""

import pytest
import torch

import spark_estimator.horovod as hvd
from spark_estimator import run


def broadcasts():
    import torch
    from torch.nn.functional import mse_loss

    import spark_estimator.horovod as hvd

    hvd.init()
    r = hvd.rank()
    torch.manual_seed(r)  # different weights on each rank
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    out = {"own": {k: v.clone() for k, v in net.state_dict().items()}}
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    out["from state_dict"] = {k: v.clone() for k, v in net.state_dict().items()}
    torch.manual_seed(10 + r)
    other = torch.nn.Linear(3, 4)
    hvd.broadcast_parameters(other.named_parameters(), root_rank=1)
    out["from named_parameters"] = [p.detach().clone() for p in other.parameters()]

    # rank 0 has stepped (Adam's state exists), rank 1 has not (created on its first step)
    opt = torch.optim.Adam(net.parameters(), lr=0.01 * (r + 1), betas=(0.8, 0.9))
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(r))
    if r == 0:
        for _ in range(3):
            opt.zero_grad()
            mse_loss(net(x), torch.zeros(5, 4)).backward()
            opt.step()
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    out["optimizer"] = opt.state_dict()
    opt.zero_grad()
    mse_loss(net(x), torch.zeros(5, 4)).backward()
    hvd.allreduce_(net[0].weight.grad)
    hvd.allreduce_(net[0].bias.grad)
    hvd.allreduce_(net[1].weight.grad)
    hvd.allreduce_(net[1].bias.grad)
    opt.step()
    out["after a step"] = [p.detach().clone() for p in net.parameters()]

    # no rank has stepped: the state is made by a step on zero gradients, then broadcast
    fresh = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in fresh.parameters()]
    wrapped = hvd.DistributedOptimizer(
        torch.optim.Adam(fresh.parameters(), lr=0.1 * (r + 1)),
        named_parameters=fresh.named_parameters(),
    )
    hvd.broadcast_optimizer_state(wrapped, root_rank=0)
    out["fresh"] = wrapped.state_dict()
    out["fresh unchanged"] = all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))
    return out


def equal(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def test_broadcasts_give_every_rank_the_roots_weights_and_optimizer_state(spark):
    r0, r1 = run(broadcasts, num_proc=2, use_gpu=False, spark=spark)
    assert not equal(r0["own"], r1["own"])
    assert equal(r0["from state_dict"], r0["own"]) and equal(r1["from state_dict"], r0["own"])
    assert equal(r0["from named_parameters"], r1["from named_parameters"])
    state0, state1 = r0["optimizer"], r1["optimizer"]
    assert len(state0["state"]) == 4 and equal(state0, state1)  # Adam's moments and steps
    assert state1["param_groups"][0]["lr"] == 0.01  # the root's, not rank 1's 0.02
    assert state1["param_groups"][0]["betas"] == (0.8, 0.9)
    assert equal(r0["after a step"], r1["after a step"])
    fresh0, fresh1 = r0["fresh"], r1["fresh"]
    assert len(fresh0["state"]) == 2 and equal(fresh0, fresh1)  # created, then the root's
    assert [s["step"].item() for s in fresh1["state"].values()] == [1.0, 1.0]
    assert fresh1["param_groups"][0]["lr"] == 0.1
    assert r0["fresh unchanged"] and r1["fresh unchanged"]  # Adam on zeros moves nothing


def test_broadcasts_refuse_what_they_cannot_send(one_rank):
    hvd.init()
    with pytest.raises(TypeError, match="params: 'n' is of type int, not a tensor"):
        hvd.broadcast_parameters({"n": 3}, root_rank=0)
    with pytest.raises(ValueError, match="root_rank: must be a rank in"):
        hvd.broadcast_parameters({}, root_rank=1)
    with pytest.raises(TypeError, match="optimizer: expected a torch.optim.Optimizer"):
        hvd.broadcast_optimizer_state(torch.nn.Linear(1, 1), root_rank=0)
