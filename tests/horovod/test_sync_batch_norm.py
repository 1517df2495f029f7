"""hvd.SyncBatchNorm on two real ranks (run(fn), local[4]) against one batch norm over the
concatenated batch in this process."""

import torch

import spark_estimator.horovod as hvd
from spark_estimator import run

ROWS = (3, 5)  # uneven batches: the statistics must weigh rows, not ranks


def batch(rank: int):
    """Rank ``rank``'s input [rows, 4 channels, 2] and the weights of its loss."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(ROWS[rank], 4, 2, generator=g) * (rank + 1) + rank
    return x, torch.randn(ROWS[rank], 4, 2, generator=g)


def norm(module):
    with torch.no_grad():
        module.weight.copy_(torch.tensor([1.0, 2.0, 0.5, -1.0]))
        module.bias.copy_(torch.tensor([0.0, 1.0, -1.0, 0.5]))
    return module


def sync_norm():
    hvd.init()
    x, w = batch(hvd.rank())
    x.requires_grad_()
    module = norm(hvd.SyncBatchNorm(4, momentum=0.3))
    out = module(x)
    (out * w).sum().backward()
    module.eval()
    return {
        "out": out.detach(),
        "grad": x.grad,
        "weight_grad": module.weight.grad,
        "running": (module.running_mean, module.running_var),
        "eval": module(x).detach(),
    }


def test_sync_batch_norm_is_one_batch_norm_over_every_ranks_rows(spark):
    ranks = run(sync_norm, num_proc=2, use_gpu=False, spark=spark)
    xs, ws = zip(*(batch(r) for r in range(2)))
    x = torch.cat(xs).requires_grad_()
    reference = norm(torch.nn.BatchNorm1d(4, momentum=0.3))
    out = reference(x)
    (out * torch.cat(ws)).sum().backward()
    parts = torch.split(torch.arange(sum(ROWS)), list(ROWS))
    for rank, rows in enumerate(parts):
        got = ranks[rank]
        torch.testing.assert_close(got["out"], out[rows].detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["grad"], x.grad[rows], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got["running"][0], reference.running_mean)
        torch.testing.assert_close(got["running"][1], reference.running_var)
        reference.eval()
        torch.testing.assert_close(got["eval"], reference(xs[rank]).detach())
        reference.train()
    # each rank's parameter gradient is its rows' part (the optimizer then averages them)
    summed = ranks[0]["weight_grad"] + ranks[1]["weight_grad"]
    torch.testing.assert_close(summed, reference.weight.grad, rtol=1e-4, atol=1e-5)
