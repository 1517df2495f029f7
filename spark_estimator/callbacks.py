"""Callbacks: hooks into the training loop, built on the driver, run on every rank.

Pass instances as ``TorchEstimator(callbacks=[...])``. Each rank gets its own unpickled
copy, so a callback's attributes are per rank. The loop calls, in order::

    on_train_begin(state)
    on_epoch_begin(epoch, state)          # epochs count from 1
    on_epoch_end(epoch, logs, state)      # logs: this epoch's history record
    on_train_end(state)

``logs`` is the epoch's record after the once-per-epoch reduction, identical on every rank:
``{"epoch": 3, "lr": [0.01], "train": {"loss": .., <metric>: ..}, "validation": {...}}``.
A callback may add JSON-able entries to it; they are kept in the history. Setting
``state.stop_training = True`` asks to stop after this epoch: rank 0's request decides and
every rank follows it. Metrics are named ``"<split>.<name>"`` when monitored, e.g.
``"validation.loss"`` or ``"train.accuracy"``.

When training resumes from a checkpoint (after a failure, or a new fit with the same
``run_id``), each callback gets rank 0's saved ``state_dict()`` back through
``load_state_dict`` before the next epoch, ``state.history`` holds the earlier epochs, and
``on_train_begin`` runs again; epochs already done are not replayed.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

MODES = ("min", "max")


@dataclass
class TrainingState:
    """What callbacks see and may change (built by the loop on each rank)."""

    rank: int
    world_size: int
    model: Any  # the torch.nn.Module being trained (not the DDP wrapper)
    optimizer: Any
    history: list[dict] = field(default_factory=list)
    epoch: int = 0
    stop_training: bool = False


class Callback:
    """Base class: override any of the hooks; each defaults to doing nothing."""

    def on_train_begin(self, state: TrainingState) -> None:
        pass

    def on_epoch_begin(self, epoch: int, state: TrainingState) -> None:
        pass

    def on_epoch_end(self, epoch: int, logs: dict, state: TrainingState) -> None:
        pass

    def on_train_end(self, state: TrainingState) -> None:
        pass

    def state_dict(self) -> dict:
        """What this callback needs to carry on after a resume. Rank 0's is saved in every
        checkpoint; made of numbers, strings, lists, dicts and tensors. Override it with
        ``load_state_dict`` in callbacks that keep state from epoch to epoch."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Take back what ``state_dict`` returned, when training resumes from a checkpoint."""


def monitored_value(logs: dict, monitor: str) -> float:
    """The value of ``"<split>.<name>"`` in an epoch's record."""
    split, _, name = monitor.partition(".")
    try:
        return float(logs[split][name])
    except (KeyError, TypeError) as e:
        raise KeyError(f"callbacks: monitor '{monitor}' is not in the epoch's record {logs}") from e


class _Monitor(Callback):
    """Tracks the best value of one monitored metric."""

    def __init__(self, monitor: str, mode: str, min_delta: float = 0.0):
        if mode not in MODES:
            raise ValueError(f"callbacks: mode must be 'min' or 'max', got {mode!r}")
        split, dot, name = monitor.partition(".")
        if split not in ("train", "validation") or not dot or not name:
            raise ValueError(
                f"callbacks: monitor must look like 'validation.loss' or 'train.<metric>', "
                f"got {monitor!r}"
            )
        self.monitor, self.mode, self.min_delta = monitor, mode, abs(min_delta)
        self.best_value: float | None = None
        self.best_epoch: int | None = None

    def improved(self, value: float) -> bool:
        """Whether ``value`` beats the best so far by more than ``min_delta``."""
        if math.isnan(value):
            return False
        if self.best_value is None:
            return True
        if self.mode == "min":
            return value < self.best_value - self.min_delta
        return value > self.best_value + self.min_delta

    def state_dict(self) -> dict:
        return {"best_value": self.best_value, "best_epoch": self.best_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.best_value, self.best_epoch = state["best_value"], state["best_epoch"]

    def update(self, epoch: int, logs: dict) -> bool:
        value = monitored_value(logs, self.monitor)
        if self.improved(value):
            self.best_value, self.best_epoch = value, epoch
            return True
        return False


class EarlyStopping(_Monitor):
    """Stop when ``monitor`` has not improved by more than ``min_delta`` for ``patience``
    epochs in a row. The epoch it stopped at is ``stopped_epoch`` and goes into the
    training summary."""

    def __init__(
        self,
        monitor: str = "validation.loss",
        mode: str = "min",
        patience: int = 3,
        min_delta: float = 0.0,
    ):
        super().__init__(monitor, mode, min_delta)
        if patience < 0:
            raise ValueError(f"callbacks: EarlyStopping patience must be >= 0, got {patience}")
        self.patience = patience
        self.wait = 0
        self.stopped_epoch: int | None = None

    def state_dict(self) -> dict:
        return {**super().state_dict(), "wait": self.wait, "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.wait, self.stopped_epoch = state["wait"], state["stopped_epoch"]

    def on_epoch_end(self, epoch: int, logs: dict, state: TrainingState) -> None:
        if self.update(epoch, logs):
            self.wait = 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_epoch = epoch
            state.stop_training = True


class BestModel(_Monitor):
    """Return the weights of the best epoch by ``monitor`` instead of the last epoch's.

    Keeps a CPU copy of the weights whenever ``monitor`` improves; the fitted model gets
    them, and the training summary records the epoch and value. The best epoch's checkpoint
    is never removed by ``keep_checkpoints``; a resumed run takes the weights back from it.
    """

    def __init__(self, monitor: str = "validation.loss", mode: str = "min"):
        super().__init__(monitor, mode)
        self.best_state: dict | None = None

    def on_epoch_end(self, epoch: int, logs: dict, state: TrainingState) -> None:
        if self.update(epoch, logs):
            self.best_state = {k: _copy(v) for k, v in state.model.state_dict().items()}

    def selection(self) -> dict | None:
        """What was selected, for the training summary; None before any epoch ended."""
        if self.best_epoch is None:
            return None
        return {
            "epoch": self.best_epoch,
            "monitor": self.monitor,
            "mode": self.mode,
            "value": self.best_value,
        }


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of a weight; a sharded one (FSDP's DTensor) stays a shard where it is."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # loaded where there are any
    if dtensor is not None and isinstance(tensor, dtensor.DTensor):
        return tensor.detach().clone()
    return tensor.detach().to("cpu", copy=True)
