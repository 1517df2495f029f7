"""Executor: ``hvd.SyncBatchNorm``, batch norm whose statistics span every rank's batch.

In training (with more than one rank) each rank sums its batch's values and squares per
channel; one allreduce (``Sum``, differentiable: ``hvd.allreduce``) of those sums and the
row count gives every rank the mean and (biased) variance of the batch all ranks hold
together, which normalize its rows; the running mean and the unbiased running variance
follow them as ``torch.nn.BatchNorm*`` do (``momentum``, or a cumulative average with
``momentum=None``). Autograd differentiates through the allreduce, so each rank's input
gradient is that of one batch norm over the concatenated batch. In eval mode, or with one
rank, it is plain batch norm. torch's own ``SyncBatchNorm`` needs CUDA; this works on the
job's group on CPU (gloo) and GPU (NCCL) alike. Any input of 2 or more dimensions
(``[N, C, ...]``), as Horovod's.
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .collectives import allreduce
from .core import Sum, rank_info


class SyncBatchNorm(_BatchNorm):
    """Horovod's ``hvd.SyncBatchNorm(num_features, eps=1e-5, momentum=0.1, affine=True,
    track_running_stats=True)``."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected 2 or more dimensions, got {input.dim()}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or rank_info().world_size == 1:
            return super().forward(input)
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        rows = torch.tensor([input.numel() // channels], dtype=input.dtype, device=input.device)
        local = torch.cat([input.sum(dims), (input * input).sum(dims), rows])
        total = allreduce(local, op=Sum, name="SyncBatchNorm")
        count = total[-1]
        mean = total[:channels] / count
        var = total[channels : 2 * channels] / count - mean * mean
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), float(count))
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (input - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out

    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: float):
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
            else:
                factor = self.momentum
            unbiased = var * count / max(count - 1.0, 1.0)
            self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
            self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
