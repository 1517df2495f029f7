"""Executor: an epoch's loss, metrics and timings, summed on the device, reduced once.

A step only appends its (detached) loss and metric values and its row count to a list:
no kernel and no host synchronisation per step. Every ``FOLD`` steps, and before a
reading, the list is folded into one float64 tensor on the device (``loss x rows`` and
``rows`` per split, the non-finite training losses counted, the first one's step kept).
At the end of the epoch each rank writes its step timings into its own slot of the same
tensor, and a single allreduce sums every rank's tensor: the history record divides by
the total rows, so the result is the exact average over all rows of all ranks, and every
rank learns every rank's timings.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...shared.spec import SPLITS
from ..data.convert import host_to_device

FOLD = 256  # steps between folds of the pending values into the sums
TIMES = ("train", "data", "compute", "communication")  # per rank, seconds of the epoch
_NONE = torch.iinfo(torch.int64).max  # no bad step yet


class EpochSums:
    """Per split: [loss x rows, rows, metric_1 x rows, ...]; the non-finite steps; then per
    rank the epoch's ``TIMES``."""

    def __init__(self, metric_names: list[str], device: torch.device, world_size: int = 1):
        self.metric_names, self.device = list(metric_names), device
        self.width = 2 + len(self.metric_names)
        self.times_at = 2 * self.width + 1
        self.sums = torch.zeros(
            self.times_at + world_size * len(TIMES), dtype=torch.float64, device=device
        )
        self.first_bad = torch.full((), _NONE, dtype=torch.int64, device=device)
        self.pending: dict[str, list] = {split: [] for split in SPLITS}
        self.copied = None  # (pinned host tensor, CUDA event) of running_loss on a GPU
        # training (loss x rows, rows) folded since the last take_window (the step scalars)
        self.window = torch.zeros(2, dtype=torch.float64, device=device)

    def _offset(self, split: str) -> int:
        return SPLITS.index(split) * self.width

    def add(
        self,
        split: str,
        loss: torch.Tensor,
        rows: int,
        metrics: list[torch.Tensor],
        step: int | None = None,
    ) -> None:
        """One batch's mean loss and metric means over ``rows`` rows (skipped when empty);
        with ``step``, a training step whose loss is checked for NaN and infinity."""
        if not rows:
            return
        pending = self.pending[split]
        pending.append((loss.detach(), rows, [m.detach() for m in metrics], step))
        if len(pending) >= FOLD:
            self._fold(split)

    def _fold(self, split: str) -> None:
        pending = self.pending[split]
        if not pending:
            return
        self.pending[split] = []
        losses = torch.cat([loss.reshape(1) for loss, _, _, _ in pending]).double()
        rows = host_to_device(
            torch.tensor([r for _, r, _, _ in pending], dtype=torch.float64), self.device
        )
        columns = [losses] + [
            torch.cat([m[i].reshape(1) for _, _, m, _ in pending]).double()
            for i in range(len(self.metric_names))
        ]
        at = self._offset(split)
        values = torch.stack(columns) @ rows
        count = float(sum(r for _, r, _, _ in pending))
        self.sums[at] += values[0]
        self.sums[at + 1] += count
        if split == "train":
            self.window[0] += values[0]
            self.window[1] += count
        self.sums[at + 2 : at + self.width] += values[1:]
        steps = [s for _, _, _, s in pending]
        if steps[0] is not None:
            bad = ~torch.isfinite(losses)
            self.sums[self.times_at - 1] += bad.sum()
            steps = host_to_device(torch.tensor(steps, dtype=torch.int64), self.device)
            first = torch.where(bad, steps, torch.full_like(steps, _NONE)).min()
            torch.minimum(self.first_bad, first, out=self.first_bad)

    def running_loss(self, split: str) -> float | None:
        """This rank's mean loss over the split's batches so far (before ``reduce``). On a
        GPU, without waiting for it: the value copied at the previous call, once there."""
        self._fold(split)
        at = self._offset(split)
        if self.device.type != "cuda":
            return _mean(self.sums[at : at + 2].tolist())
        value = None
        if self.copied is not None and self.copied[1].query():
            value, self.copied = _mean(self.copied[0].tolist()), None
        if self.copied is None:
            host = torch.empty(2, dtype=torch.float64, pin_memory=True)
            host.copy_(self.sums[at : at + 2], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.copied = (host, event)
        return value

    def take_window(self) -> torch.Tensor:
        """This rank's training (loss x rows, rows) since the previous call (or the epoch's
        start, not counting a commit's sums it resumed with), on the device: no host
        synchronisation."""
        self._fold("train")
        window, self.window = self.window, torch.zeros_like(self.window)
        return window

    def partial(self) -> tuple[list[float], int | None]:
        """This rank's sums so far (not the times) and its first bad step, for a commit."""
        for split in SPLITS:
            self._fold(split)
        first = int(self.first_bad.item())
        return self.sums[: self.times_at].tolist(), None if first == _NONE else first

    def resume(self, sums: list[float], first_bad: int | None) -> None:
        """Start from a commit's ``partial()`` values."""
        values = torch.tensor(sums, dtype=torch.float64)
        self.sums[: self.times_at] += host_to_device(values, self.device)
        if first_bad is not None:
            self.first_bad.fill_(min(first_bad, int(self.first_bad.item())))

    def reduce(self, rank: int, times: dict[str, float]) -> None:
        """Sum across ranks, with this rank's ``times`` in its slot: the epoch's one
        collective for metrics."""
        for split in SPLITS:
            self._fold(split)
        at = self.times_at + rank * len(TIMES)
        times = torch.tensor([times[k] for k in TIMES], dtype=torch.float64)
        self.sums[at : at + len(TIMES)] = host_to_device(times, self.device)
        dist.all_reduce(self.sums)
        self.values = self.sums.tolist()  # read once, after the epoch

    @property
    def non_finite_steps(self) -> int:
        return int(self.values[self.times_at - 1])

    @property
    def first_bad_step(self) -> int | None:
        """This rank's first training step with a loss that was not finite (None: none)."""
        first = int(self.first_bad.item())
        return None if first == _NONE else first

    def record(self, split: str) -> dict[str, float] | None:
        """The split's averages after ``reduce``: {"loss": ..., metric: ...}; None without rows."""
        at = self._offset(split)
        values = self.values[at : at + self.width]
        rows = values[1]
        if not rows:
            return None
        names = ["loss", *self.metric_names]
        return {name: values[i if i == 0 else i + 1] / rows for i, name in enumerate(names)}

    def times(self) -> dict[str, list[float]]:
        """After ``reduce``: every rank's seconds of the epoch, per kind, in rank order."""
        per_rank = self.values[self.times_at :]
        n = len(TIMES)
        return {
            kind: [round(per_rank[r * n + i], 4) for r in range(len(per_rank) // n)]
            for i, kind in enumerate(TIMES)
        }


def _mean(pair: list[float]) -> float | None:
    total, rows = pair
    return total / rows if rows else None


def non_finite_loss_error(
    epoch: int, first_bad_step: int | None, bad_steps: int, world: int, rank: int, device, last
) -> FloatingPointError:
    """terminate_on_nan's error, the same on every rank (both trainers): the first step with
    a loss that was not finite over all ranks (ties to the lowest rank; one collective),
    ``bad_steps`` of them this epoch, and ``last``, the last good checkpoint (or None)."""
    code = first_bad_step * world + rank if first_bad_step is not None else _NONE
    code = torch.tensor([code], dtype=torch.int64, device=device)
    dist.all_reduce(code, op=dist.ReduceOp.MIN)
    step, bad_rank = divmod(int(code.item()), world)
    kept = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
    return FloatingPointError(
        f"terminate_on_nan: the training loss was NaN or infinite at epoch {epoch}, step "
        f"{step} (rank {bad_rank}; {bad_steps} such steps this epoch); training stopped and "
        f"{kept}"
    )
