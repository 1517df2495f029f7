"""Horovod's process sets on three real ranks (run(fn), local[4]): each collective over a set
equals the same op computed by hand over the set's ranks; ranks outside are unaffected."""

import pytest
import torch

import spark_estimator.horovod as hvd
from spark_estimator import run


def in_sets():
    import torch

    import spark_estimator.horovod as hvd

    odd = hvd.ProcessSet([2, 1])
    hvd.init(process_sets=[odd])
    r = hvd.rank()
    even = hvd.add_process_set([0, 2])
    out = {
        "ids": (hvd.global_process_set.process_set_id, odd.process_set_id, even.process_set_id),
        "even": (even.ranks, even.size(), even.included()),
        "odd": (odd.ranks, odd.size(), odd.included()),
        "global": (hvd.global_process_set.ranks, hvd.global_process_set.size()),
    }
    errors = {}

    def refused(what, call, kind=ValueError):
        try:
            call()
        except kind as e:
            errors[what] = str(e)

    x = torch.tensor([r + 1.0, 10.0 * (r + 1)])  # [1, 10], [2, 20], [3, 30]
    if even.included():
        out["even rank"] = even.rank()
        out["average"] = hvd.allreduce(x, process_set=even)
        out["sum"] = hvd.allreduce(x, op=hvd.Sum, process_set=even)
        out["max"] = hvd.allreduce(x, op=hvd.Max, process_set=even)
        out["adasum"] = hvd.allreduce(torch.eye(3)[r], op=hvd.Adasum, process_set=even)
        out["grouped"] = hvd.grouped_allreduce([x, torch.tensor([r])], op=hvd.Sum, process_set=even)
        h = hvd.allreduce_async(x, op=hvd.Sum, process_set=even)
        out["async"] = hvd.synchronize(h)
        out["allgather"] = hvd.allgather(torch.full((r + 1, 1), r), process_set=even)
        out["grouped allgather"] = hvd.grouped_allgather([torch.tensor([r])], process_set=even)
        out["broadcast"] = hvd.broadcast(x, root_rank=2, process_set=even)
        y = x.clone()
        hvd.synchronize(hvd.broadcast_async_(y, root_rank=2, process_set=even))
        out["broadcast_async_"] = y
        out["alltoall"] = hvd.alltoall(torch.tensor([10.0 * r, 10.0 * r + 1]), process_set=even)
        out["reducescatter"] = hvd.reducescatter(
            torch.arange(3.0) * (r + 1), op=hvd.Sum, process_set=even
        )
        out["broadcast_object"] = hvd.broadcast_object({"from": r}, root_rank=2, process_set=even)
        out["allgather_object"] = hvd.allgather_object(r, process_set=even)
        sparse = torch.sparse_coo_tensor([[r]], [float(r + 1)], (3,))
        summed = hvd.synchronize(hvd.sparse_allreduce_async(sparse, op=hvd.Sum, process_set=even))
        out["sparse"] = summed.to_dense().tolist()
        g = torch.ones(r + 1, requires_grad=True)  # 1 row on rank 0, 3 on rank 2
        (hvd.allgather(g, process_set=even) * torch.arange(4.0) * (r + 1)).sum().backward()
        out["allgather grad"] = g.grad
        hvd.barrier(process_set=even)
        refused("root outside", lambda: hvd.broadcast(x, root_rank=1, process_set=even))

        # the optimizer averages over ranks 0 and 2 only; its state comes from rank 2
        torch.manual_seed(r)
        net = torch.nn.Linear(2, 1, bias=False)
        opt = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.5 * r)
        hvd.broadcast_parameters(net.state_dict(), root_rank=2, process_set=even)
        hvd.broadcast_optimizer_state(opt, root_rank=2, process_set=even)
        out["weights broadcast"] = net.weight.detach().clone()
        out["momentum"] = opt.param_groups[0]["momentum"]
        opt = hvd.DistributedOptimizer(
            opt, named_parameters=net.named_parameters(), process_set=even
        )
        net(torch.tensor([[r + 1.0, 1.0]])).sum().backward()  # gradient [r + 1, 1]
        opt.synchronize()
        out["gradient"] = net.weight.grad.clone()
    else:
        refused("rank outside", even.rank)
        refused("allreduce outside", lambda: hvd.allreduce(x, process_set=even))
        refused("allgather outside", lambda: hvd.allgather(x, process_set=even))
        refused(
            "optimizer outside",
            lambda: hvd.DistributedOptimizer(
                torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), process_set=even
            ),
        )
    if odd.included():
        out["odd average"] = hvd.allreduce(x, process_set=odd)
        out["odd allgather"] = hvd.allgather(torch.tensor([r]), process_set=odd)
    out["whole job"] = hvd.allreduce(x, op=hvd.Sum)  # ranks outside a set: unaffected
    refused("duplicate", lambda: hvd.add_process_set([2, 0]))
    refused("global duplicate", lambda: hvd.add_process_set([0, 1, 2]))
    refused("out of range", lambda: hvd.add_process_set([0, 3]))
    refused("not a set", lambda: hvd.allreduce(x, process_set=[0, 2]))
    out["removed"] = (hvd.remove_process_set(even), even.process_set_id, even.size())
    out["removed again"] = hvd.remove_process_set(even)
    out["remove global"] = hvd.remove_process_set(hvd.global_process_set)
    refused("removed set", lambda: hvd.allreduce(x, process_set=even))
    out["errors"] = errors
    return out


def test_collectives_over_a_process_set_are_those_of_its_ranks(spark):
    results = run(in_sets, num_proc=3, use_gpu=False, spark=spark)
    for r, out in enumerate(results):
        assert out["ids"] == (0, 1, 2)
        assert out["even"] == ([0, 2], 2, r != 1)
        assert out["odd"] == ([1, 2], 2, r != 0)  # sorted, as Horovod's
        assert out["global"] == ([0, 1, 2], 3)
        # every rank: [1, 10] + [2, 20] + [3, 30]
        assert out["whole job"].tolist() == [6.0, 60.0]
        if r in (1, 2):
            assert out["odd average"].tolist() == [2.5, 25.0]  # ([2, 20] + [3, 30]) / 2
            assert out["odd allgather"].tolist() == [1, 2]
        errors = out["errors"]
        assert "a duplicate of the process set ProcessSet(process_set_id=2" in errors["duplicate"]
        assert "process_set_id=0" in errors["global duplicate"]
        assert "distinct ranks in [0, 3), got [0, 3]" in errors["out of range"]
        assert "process_set: expected an hvd.ProcessSet, got [0, 2]" in errors["not a set"]
        assert out["removed"] == (True, None, None)
        assert out["removed again"] is False and out["remove global"] is False
        assert "has not been added" in errors["removed set"]
        if r == 1:
            assert "Process is not part of provided process set" in errors["rank outside"]
            assert errors["allreduce outside"].startswith(
                "Allreduce: Rank 1 is not a member of the provided process set"
            )
            assert "Allgather: Rank 1 is not a member" in errors["allgather outside"]
            assert "DistributedOptimizer: Rank 1 is not a member" in errors["optimizer outside"]
            continue
        s = [0, 2].index(r)  # this rank's rank in the set
        assert out["even rank"] == s
        # ranks 0 and 2: [1, 10] and [3, 30]
        assert out["average"].tolist() == [2.0, 20.0]  # divided by the set's size
        assert out["sum"].tolist() == out["async"].tolist() == [4.0, 40.0]
        assert out["max"].tolist() == [3.0, 30.0]
        assert out["adasum"].tolist() == [1.0, 0.0, 1.0]  # orthogonal: added
        assert [t.tolist() for t in out["grouped"]] == [[4.0, 40.0], [2]]
        assert out["allgather"].tolist() == [[0], [2], [2], [2]]
        assert out["grouped allgather"][0].tolist() == [0, 2]
        assert out["broadcast"].tolist() == out["broadcast_async_"].tolist() == [3.0, 30.0]
        # equal splits: rank 0 of the set gets both ranks' first element, rank 1 the second
        assert out["alltoall"].tolist() == [[0.0, 20.0], [1.0, 21.0]][s]
        # the sum [0, 1, 2] * (1 + 3), rows cut 2, 1
        assert out["reducescatter"].tolist() == [[0.0, 4.0], [8.0]][s]
        assert out["broadcast_object"] == {"from": 2}
        assert out["allgather_object"] == [0, 2]
        assert out["sparse"] == [1.0, 0.0, 3.0]
        # the set's average weight (1 + 3) / 2 on the set's rows [0..3], this rank's rows
        assert out["allgather grad"].tolist() == [[0.0], [2.0, 4.0, 6.0]][s]
        assert (
            "one of the process set's (global) ranks [0, 2], got 1" in out["errors"]["root outside"]
        )
        assert out["momentum"] == 1.0  # rank 2's
        assert out["weights broadcast"].tolist() == results[2]["weights broadcast"].tolist()
        # gradients [1, 1] (rank 0) and [3, 1] (rank 2), averaged over the set
        assert out["gradient"].tolist() == [[2.0, 1.0]]


def test_a_process_set_before_it_is_added(one_rank):
    ps = hvd.ProcessSet([3, 1])
    assert ps.ranks == [1, 3] and ps.process_set_id is None
    assert (ps.size(), ps.rank(), ps.included()) == (None, None, None)
    with pytest.raises(ValueError, match="ranks: expected a list of ranks"):
        hvd.ProcessSet("01")
    with pytest.raises(ValueError, match="ranks: expected a list of ranks"):
        hvd.ProcessSet([0, 1.0])
    hvd.init()
    assert hvd.global_process_set.ranks == [0]
    with pytest.raises(ValueError, match="has not been added"):
        hvd.allreduce(torch.ones(1), process_set=ps)
    with pytest.raises(ValueError, match=r"process_sets: expected a list of hvd.ProcessSet"):
        hvd.init(process_sets=ps)
