"""Horovod's collectives across three real ranks (run(fn) on local[4]), and their checks."""

import pytest
import torch

import spark_estimator.horovod as hvd
from spark_estimator import run


def collectives():
    import time

    import torch

    import spark_estimator.horovod as hvd

    hvd.init()
    r = hvd.rank()
    x = torch.tensor([r + 1.0, 2.0 * (r + 1)])  # [1, 2], [2, 4], [3, 6]
    out = {
        "ranks": (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()),
        "cross": (hvd.cross_rank(), hvd.cross_size()),
        "average": hvd.allreduce(x, name="x"),
        "average=False": hvd.allreduce(x, average=False),
        "sum": hvd.allreduce(x, op=hvd.Sum),
        "min": hvd.allreduce(x, op=hvd.Min),
        "max": hvd.allreduce(x, op=hvd.Max),
        "product": hvd.allreduce(x, op=hvd.Product),
        "scaled sum": hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=3.0),
        "scaled average": hvd.allreduce(x, prescale_factor=2.0),
        "int average": hvd.allreduce(torch.tensor([r + 1, 10])),
        "fp16": hvd.allreduce(torch.tensor([0.1 * (r + 1)]), compression=hvd.Compression.fp16),
        "bf16": hvd.allreduce(torch.tensor([0.1 * (r + 1)]), compression=hvd.Compression.bf16),
        "adasum orthogonal": hvd.allreduce(torch.eye(3)[r], op=hvd.Adasum),
        "adasum identical": hvd.allreduce(torch.tensor([1.0, -2.0]), op=hvd.Adasum),
        "grouped": hvd.grouped_allreduce(
            [x, torch.tensor([r]), torch.full((2, 2), float(r))], op=hvd.Sum
        ),
        "allgather": hvd.allgather(torch.full((r + 1, 2), r)),
        "allgather 0-d": hvd.allgather(torch.tensor(r)),
        "broadcast": hvd.broadcast(x, root_rank=1),
        "broadcast_object": hvd.broadcast_object({"from": r}, root_rank=2),
        "allgather_object": hvd.allgather_object("a" * r),
    }
    out["input unchanged"] = x
    y = x.clone()
    out["allreduce_ returns its input"] = hvd.allreduce_(y, op=hvd.Sum) is y
    out["allreduce_"] = y
    z = x.clone()
    out["broadcast_ returns its input"] = hvd.broadcast_(z, root_rank=2) is z
    out["broadcast_"] = z
    errors = {}
    for what, call in {
        "op and average": lambda: hvd.allreduce(x, average=True, op=hvd.Sum),
        "unknown op": lambda: hvd.allreduce(x, op=7),
        "root_rank": lambda: hvd.broadcast(x, root_rank=3, name="w"),
        "allgather shapes": lambda: hvd.allgather(torch.zeros(1, r + 1), name="g"),
    }.items():
        try:
            call()
        except ValueError as e:
            errors[what] = str(e)
    out["errors"] = errors
    hvd.barrier()
    if r == 1:
        time.sleep(2)  # the last to join
    out["join"] = hvd.join()
    return out


def test_collectives_on_three_ranks(spark):
    results = run(collectives, num_proc=3, use_gpu=False, spark=spark)
    for r, out in enumerate(results):
        assert out["ranks"] == (r, 3, r, 3)  # one host
        assert out["cross"] == (0, 1)
        assert out["average"].tolist() == [2.0, 4.0]
        assert out["average=False"].tolist() == out["sum"].tolist() == [6.0, 12.0]
        assert out["min"].tolist() == [1.0, 2.0]
        assert out["max"].tolist() == [3.0, 6.0]
        assert out["product"].tolist() == [6.0, 48.0]
        assert out["scaled sum"].tolist() == [36.0, 72.0]
        assert out["scaled average"].tolist() == [4.0, 8.0]
        assert out["int average"].dtype == torch.int64
        assert out["int average"].tolist() == [2, 10]
        # travelled in half precision: near the float32 average, not equal to it
        for dtype, tol in (("fp16", 1e-3), ("bf16", 1e-2)):
            assert out[dtype].dtype == torch.float32
            assert 0 < abs(out[dtype].item() - 0.2) < tol, dtype
        assert out["adasum orthogonal"].tolist() == [1.0, 1.0, 1.0]  # orthogonal: added
        assert out["adasum identical"].tolist() == [1.0, -2.0]  # identical: averaged
        grouped = out["grouped"]
        assert grouped[0].tolist() == [6.0, 12.0]
        assert grouped[1].dtype == torch.int64 and grouped[1].tolist() == [3]
        assert grouped[2].tolist() == [[3.0, 3.0], [3.0, 3.0]]
        assert out["allgather"].tolist() == [[0, 0], [1, 1], [1, 1], [2, 2], [2, 2], [2, 2]]
        assert out["allgather 0-d"].tolist() == [0, 1, 2]
        assert out["broadcast"].tolist() == [2.0, 4.0]
        assert out["broadcast_object"] == {"from": 2}
        assert out["allgather_object"] == ["", "a", "aa"]
        assert out["input unchanged"].tolist() == [r + 1.0, 2.0 * (r + 1)]
        assert out["allreduce_ returns its input"] and out["allreduce_"].tolist() == [6.0, 12.0]
        assert out["broadcast_ returns its input"] and out["broadcast_"].tolist() == [3.0, 6.0]
        errors = out["errors"]
        assert "op and average: give one" in errors["op and average"]
        assert "op: expected one of hvd.Average" in errors["unknown op"]
        assert "root_rank (tensor 'w'): must be a rank in [0, 3), got 3" in errors["root_rank"]
        assert "allgather (tensor 'g')" in errors["allgather shapes"]
        assert "[(1, 1), (1, 2), (1, 3)]" in errors["allgather shapes"]
        assert out["join"] == 1


def test_one_rank_reduces_to_itself(one_rank):
    hvd.init()
    x = torch.tensor([1.0, 2.0])
    assert hvd.allreduce(x).tolist() == [1.0, 2.0]
    assert hvd.allreduce(x, op=hvd.Sum, postscale_factor=0.5).tolist() == [0.5, 1.0]
    assert hvd.allgather(x).tolist() == [1.0, 2.0]
    assert hvd.join() == 0
    assert hvd.join() == 0  # a second join has its own count


@pytest.mark.parametrize("op", [hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product])
def test_ops_are_horovods_numbers(op):
    assert (
        int(op) == {"AVERAGE": 0, "SUM": 1, "ADASUM": 2, "MIN": 3, "MAX": 4, "PRODUCT": 5}[op.name]
    )


def in_autograd():
    import torch

    import spark_estimator.horovod as hvd

    hvd.init()
    r = hvd.rank()
    grads = {}
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum) * (r + 1)).sum().backward()
    grads["allreduce"] = x.grad
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    (hvd.allreduce(x) * (r + 1)).sum().backward()  # Average
    grads["average"] = x.grad
    rows = torch.ones(r + 1, 2, requires_grad=True)  # 1 row on rank 0, 2 on rank 1
    gathered = hvd.allgather(rows)
    (gathered * torch.arange(6.0).view(3, 2) * (r + 1)).sum().backward()
    grads["allgather"] = rows.grad
    x = torch.tensor([3.0], requires_grad=True)
    (hvd.broadcast(x, root_rank=1) * (r + 1)).sum().backward()
    grads["broadcast"] = x.grad
    return grads


def test_allreduce_allgather_and_broadcast_backpropagate_as_horovods(spark):
    """Rank r's loss weighs the collective's result by r + 1 (1 and 2)."""
    ranks = run(in_autograd, num_proc=2, use_gpu=False, spark=spark)
    for rank, grads in enumerate(ranks):
        # Sum: d/dx_r of sum_s (s + 1) * sum(x) = 1 + 2
        assert grads["allreduce"].tolist() == [3.0, 3.0]
        # Average: the gradient allreduced with the same op, (1 + 2) / 2: also the gradient
        # of the ranks' summed losses, sum_s (s + 1) / 2
        assert grads["average"].tolist() == [1.5, 1.5]
        # allgather: the ranks' average weight, 1.5 x rows [0..5], this rank's rows
        weights = (torch.arange(6.0).view(3, 2) * 1.5)[[0] if rank == 0 else [1, 2]]
        assert grads["allgather"].tolist() == weights.tolist()
        # broadcast from rank 1: the average weight on the root, zeros elsewhere
        assert grads["broadcast"].tolist() == ([1.5] if rank == 1 else [0.0])
