"""hvd.join() on two real ranks (run(fn), local[4]): a joined rank contributes zeros to the
other's allreduces (an Average still divides by 2) until both have joined; other
collectives are refused on both ranks instead of hanging; uneven batches train."""

from spark_estimator import run

BATCHES = (3, 1)  # rank 0 trains 3 batches, rank 1 one, then each joins


def joining():
    import time

    import torch

    import spark_estimator.horovod as hvd

    hvd.init()
    r = hvd.rank()
    out, errors = {}, {}
    x = torch.tensor([r + 1.0, 4.0])  # rank 0 [1, 4], rank 1 [2, 4]
    if r == 1:
        errors["first join"] = _error(hvd.join)  # rank 0's Adasum allreduce ends it
        errors["second join"] = _error(hvd.join)  # and its allgather this one
        time.sleep(1.0)  # rank 0's allreduce_async comes first: it must not wait
        out["late"] = hvd.allreduce(x, op=hvd.Sum)
        out["join"] = hvd.join()
    else:
        out["average"] = hvd.allreduce(x)
        out["sum"] = hvd.allreduce(x, op=hvd.Sum)
        out["min"] = hvd.allreduce(x, op=hvd.Min)
        out["max"] = hvd.allreduce(-x, op=hvd.Max)
        out["product"] = hvd.allreduce(x, op=hvd.Product)
        out["int"] = hvd.allreduce(torch.tensor([7, 8]), op=hvd.Sum)
        int32 = torch.tensor([5], dtype=torch.int32)
        out["grouped"] = hvd.grouped_allreduce([x, int32], op=hvd.Sum)
        out["fp16"] = hvd.allreduce(x, compression=hvd.Compression.fp16)
        out["reducescatter"] = hvd.reducescatter(x, op=hvd.Sum)
        h = hvd.allreduce_async(x, op=hvd.Sum)
        out["async"] = hvd.synchronize(h)
        errors["adasum"] = _error(lambda: hvd.allreduce(x, op=hvd.Adasum))
        errors["allgather"] = _error(lambda: hvd.allgather(x, name="g"))
        began = time.monotonic()
        h = hvd.allreduce_async(x, op=hvd.Sum)  # rank 1 is 1 s late
        out["async returned after"] = time.monotonic() - began
        out["late"] = hvd.synchronize(h)
        out["late waited"] = time.monotonic() - began
        time.sleep(1.0)  # rank 1 joins first
        out["join"] = hvd.join()
    out["errors"] = errors

    # uneven batches: each rank trains BATCHES[r] batches, then joins
    def batch(rank, i):
        return torch.tensor([[rank + 1.0, i + 1.0]]), torch.tensor([[2.0 * i - rank]])

    def model():
        net = torch.nn.Linear(2, 1)
        with torch.no_grad():
            net.weight.copy_(torch.tensor([[0.5, -0.25]]))
            net.bias.fill_(0.125)
        return net

    def gradients(net, rank, i):
        net.zero_grad()
        inputs, target = batch(rank, i)
        torch.nn.functional.mse_loss(net(inputs), target).backward()
        return [p.grad.clone() for p in net.parameters()]

    net = model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters()
    )
    for i in range(BATCHES[r]):
        opt.zero_grad()
        inputs, target = batch(r, i)
        torch.nn.functional.mse_loss(net(inputs), target).backward()
        opt.step()
    out["trained join"] = hvd.join()
    out["trained"] = [p.detach().clone() for p in net.parameters()]
    # by hand: the sum of the gradients of the ranks still training (zeros from the
    # joined one), times 1 / 2, the job's size, as the allreduce computes it
    ref = model()
    for i in range(max(BATCHES)):
        if i >= BATCHES[r]:
            break
        local = [gradients(ref, s, i) for s in range(2) if i < BATCHES[s]]
        with torch.no_grad():
            for k, p in enumerate(ref.parameters()):
                total = local[0][k].clone()
                for g in local[1:]:
                    total += g[k]
                p.add_(total.mul_(0.5), alpha=-0.1)
    out["expected"] = [p.detach().clone() for p in ref.parameters()]
    return out


def _error(call) -> str:
    try:
        call()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_joined_rank_contributes_zeros_until_every_rank_has_joined(spark):
    ranks = run(joining, num_proc=2, use_gpu=False, spark=spark)
    zero, one = ranks
    # rank 1 joined: rank 0's allreduces get zeros from it, an Average divides by 2
    assert zero["average"].tolist() == [0.5, 2.0]
    assert zero["sum"].tolist() == zero["async"].tolist() == [1.0, 4.0]
    assert zero["int"].tolist() == [7, 8]
    assert [t.tolist() for t in zero["grouped"]] == [[1.0, 4.0], [5]]
    assert zero["fp16"].tolist() == [0.5, 2.0] and zero["fp16"].dtype.is_floating_point
    assert zero["reducescatter"].tolist() == [1.0]  # rows cut 1, 1: rank 0 keeps the first
    # Min, Max, Product: the joined rank contributes the op's identity
    assert zero["min"].tolist() == [1.0, 4.0]
    assert zero["max"].tolist() == [-1.0, -4.0]
    assert zero["product"].tolist() == [1.0, 4.0]
    # an Adasum allreduce and an allgather with a joined rank: refused on both ranks
    assert (
        "allreduce with op=Adasum called by ranks [0] while ranks [1] had called hvd.join()"
        in (zero["errors"]["adasum"])
    )
    assert (
        "allgather (tensor 'g') called by ranks [0] while ranks [1]"
        in (zero["errors"]["allgather"])
    )
    assert (
        "allreduce with op=Adasum called by ranks [0] while ranks [1]"
        in (one["errors"]["first join"])
    )
    assert "allgather called by ranks [0] while ranks [1]" in one["errors"]["second join"]
    # the asynchronous allreduce returned at once although rank 1 came 1 s late
    assert zero["async returned after"] < 0.5 and zero["late waited"] > 0.7
    assert zero["late"].tolist() == one["late"].tolist() == [3.0, 8.0]
    assert zero["join"] == one["join"] == 0  # rank 0 joined last
    # uneven batches: rank 0's last two steps averaged its gradient with rank 1's zeros
    assert zero["trained join"] == one["trained join"] == 0
    for out in ranks:
        assert [t.tolist() for t in out["trained"]] == [t.tolist() for t in out["expected"]]
    assert [t.tolist() for t in zero["trained"]] != [t.tolist() for t in one["trained"]]


def _join_on(monkeypatch, store):
    """hvd.join() on rank 0 of 2 whose job store is ``store``; the error it raises."""
    import pytest
    import torch
    import torch.distributed as dist

    from spark_estimator.horovod import joined
    from spark_estimator.worker.comm.ranks import RankInfo

    monkeypatch.setattr(joined, "rank_info", lambda: RankInfo(0, 2, 0, 2, torch.device("cpu")))
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    with pytest.raises(Exception) as e:
        joined.join()
    return e.value


def _server_and_client():
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=5)
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
    return server, dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)


def test_join_refuses_a_sealed_counter_that_a_stranger_overwrote(monkeypatch):
    from spark_estimator.worker.comm.sealed_store import ForgedValue, SealedStore

    server, client = _server_and_client()
    server.set("spark_estimator.horovod/join/calls/0", b"not-a-number")
    error = _join_on(monkeypatch, SealedStore(client, "a" * 32))
    assert isinstance(error, ForgedValue)
    assert "'spark_estimator.horovod/join/calls/0'" in str(error)


def test_join_says_what_a_plain_store_that_went_away_does(monkeypatch):
    # a script's group: torch's own, unsealed client (env://) of rank 0's server, gone.
    # (Not a stranger's b"not-a-number" under the counter, though the note names it too:
    # torch's client then raises most times, but a few adds in a hundred return 1 and
    # leave the value as it was - measured on torch 2.13 - so such a test cannot hold.)
    import gc

    import torch.distributed as dist

    server, client = _server_and_client()
    del server
    gc.collect()
    error = _join_on(monkeypatch, client)
    assert isinstance(error, dist.DistError)  # still a lost store, which starts a run again
    note = "\n".join(getattr(error, "__notes__", []))
    assert "hvd.join()" in note and "'spark_estimator.horovod/join/calls/0'" in note
    assert "went away" in note and "not a number" in note
