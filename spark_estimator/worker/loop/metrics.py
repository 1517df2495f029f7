"""Executor: an epoch's loss and metrics, summed on the device, reduced once per epoch.

Each rank adds ``value x rows`` per batch into one float64 tensor on its device (no
host synchronisation per step). At the end of the epoch a single allreduce sums every
rank's tensor, and the history record divides by the total rows, so the result is the
exact average over all rows of all ranks. The same tensor counts the training steps
whose loss was not finite.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...shared.spec import SPLITS


class EpochSums:
    """Per split: [loss x rows, rows, metric_1 x rows, ...]; plus the non-finite steps."""

    def __init__(self, metric_names: list[str], device: torch.device):
        self.metric_names = list(metric_names)
        self.width = 2 + len(self.metric_names)
        self.sums = torch.zeros(2 * self.width + 1, dtype=torch.float64, device=device)
        self.first_bad_step = torch.full((), -1, dtype=torch.int64, device=device)

    def _offset(self, split: str) -> int:
        return SPLITS.index(split) * self.width

    def add(self, split: str, loss: torch.Tensor, rows: int, metrics: list[torch.Tensor]):
        """One batch's mean loss and metric means over ``rows`` rows (skipped when empty)."""
        if not rows:
            return
        at = self._offset(split)
        values = torch.stack([loss.detach().double(), *metrics]) * rows
        self.sums[at] += values[0]
        self.sums[at + 1] += rows
        if metrics:
            self.sums[at + 2 : at + self.width] += values[1:]

    def check_finite(self, loss: torch.Tensor, step: int) -> None:
        """Count a training step whose loss is NaN or infinite; remember the first one."""
        bad = ~torch.isfinite(loss.detach())
        self.sums[-1] += bad.double()
        first = torch.where(bad & (self.first_bad_step < 0), step, self.first_bad_step)
        self.first_bad_step.copy_(first)

    def running_loss(self, split: str) -> float | None:
        """This rank's mean loss over the split's batches so far (before ``reduce``)."""
        at = self._offset(split)
        total, rows = self.sums[at : at + 2].tolist()
        return total / rows if rows else None

    def reduce(self) -> None:
        """Sum across ranks: the epoch's one collective for metrics."""
        dist.all_reduce(self.sums)

    @property
    def non_finite_steps(self) -> int:
        return int(self.sums[-1].item())

    def record(self, split: str) -> dict[str, float] | None:
        """The split's averages after ``reduce``: {"loss": ..., metric: ...}; None without rows."""
        at = self._offset(split)
        values = self.sums[at : at + self.width].tolist()
        rows = values[1]
        if not rows:
            return None
        names = ["loss", *self.metric_names]
        return {name: values[i if i == 0 else i + 1] / rows for i, name in enumerate(names)}
