"""Horovod's asynchronous collectives, alltoall and reducescatter on three real ranks
(run(fn), local[4])."""

import torch

from spark_estimator import run


def asynchronous():
    import time

    import torch

    import spark_estimator.horovod as hvd

    hvd.init()
    r = hvd.rank()
    out = {}
    hvd.barrier()  # every rank here at once
    # a real handle: rank 2 comes 1.5 s late; the others' call returns at once and
    # poll() says False until it has come
    if r == 2:
        time.sleep(1.5)
    began = time.monotonic()
    handle = hvd.allreduce_async(torch.tensor([r + 1.0]), op=hvd.Sum)
    out["returned after"] = time.monotonic() - began
    out["polled before"] = hvd.poll(handle)
    out["sum"] = hvd.synchronize(handle).item()
    out["waited"] = time.monotonic() - began
    out["polled spent"] = hvd.synchronize(handle)  # a spent handle: None, as Horovod's

    x = torch.tensor([1.0, 2.0]) * (r + 1)
    sync = hvd.allreduce(x)
    h = hvd.allreduce_async_(x)
    out["async_ equals sync"] = torch.equal(hvd.synchronize(h), sync) and torch.equal(x, sync)
    tensors = [torch.ones(2) * r, torch.arange(3) * r]  # two dtypes
    out["grouped"] = hvd.synchronize(hvd.grouped_allreduce_async(tensors, op=hvd.Sum))
    rows = torch.full((r + 1, 2), float(r))
    out["allgather"] = hvd.synchronize(hvd.allgather_async(rows))
    out["grouped allgather"] = hvd.grouped_allgather([rows, torch.tensor([r])])
    b = torch.tensor([float(r)])
    hvd.synchronize(hvd.broadcast_async_(b, root_rank=2))
    out["broadcast_"] = b.item()
    out["broadcast"] = hvd.synchronize(hvd.broadcast_async(torch.tensor([r * 10]), 1)).item()
    sparse = torch.sparse_coo_tensor([[r]], [float(r + 1)], (4,))
    summed = hvd.synchronize(hvd.sparse_allreduce_async(sparse, op=hvd.Sum))
    out["sparse"] = summed.to_dense().tolist()

    # alltoall: rank r sends rank s its s + 1 rows, each holding 10 * r + s
    send = torch.cat([torch.full((s + 1, 2), 10.0 * r + s) for s in range(3)])
    received, counts = hvd.alltoall(send, splits=[1, 2, 3])
    out["alltoall"] = (received[:, 0].tolist(), counts.tolist())
    out["alltoall equal"] = hvd.alltoall(torch.arange(6.0) + 10 * r).tolist()
    x = torch.arange(6.0, requires_grad=True)
    (hvd.alltoall(x) * (r + 1)).sum().backward()
    out["alltoall grad"] = x.grad.tolist()
    out["reducescatter"] = hvd.reducescatter(torch.arange(7.0) * (r + 1), op=hvd.Sum).tolist()
    grouped = hvd.grouped_reducescatter([torch.arange(7.0) * (r + 1), torch.ones(3, 2) * r])
    out["grouped reducescatter"] = [t.tolist() for t in grouped]
    return out


def test_async_collectives_return_handles_and_the_rest_of_the_api_works(spark):
    ranks = run(asynchronous, num_proc=3, use_gpu=False, spark=spark)
    for r, out in enumerate(ranks):
        assert out["sum"] == 6.0 and out["polled spent"] is None
        if r != 2:  # it did not wait for the late rank
            assert out["returned after"] < 0.5 and out["polled before"] is False
            assert out["waited"] > 1.0
        assert out["async_ equals sync"]
        assert [t.tolist() for t in out["grouped"]] == [[3.0, 3.0], [0, 3, 6]]
        assert out["allgather"].tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]] + [[2.0] * 2] * 3
        assert out["grouped allgather"][1].tolist() == [0, 1, 2]
        assert out["broadcast_"] == 2.0 and out["broadcast"] == 10
        assert out["sparse"] == [1.0, 2.0, 3.0, 0.0]
        # from each rank s, its r + 1 rows for this rank r: 10 * s + r
        values = [10.0 * s + r for s in range(3) for _ in range(r + 1)]
        assert out["alltoall"] == (values, [r + 1] * 3)
        # equal splits of 6 rows: 2 from each rank
        assert out["alltoall equal"] == [10.0 * s + 2 * r + i for s in range(3) for i in range(2)]
        # gradient: this rank's rows went to rank s, which weighs them by s + 1
        assert out["alltoall grad"] == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
        # the sum 6 * arange(7), rows cut 3, 2, 2
        full = (torch.arange(7.0) * 6).tolist()
        assert out["reducescatter"] == [full[0:3], full[3:5], full[5:7]][r]
        # averaged (the default): 2 * arange(7) cut 3, 2, 2; ones * 1 cut one row each
        mean = (torch.arange(7.0) * 2).tolist()
        assert out["grouped reducescatter"] == [
            [mean[0:3], mean[3:5], mean[5:7]][r],
            [[1.0, 1.0]],
        ]
