"""Executor: continue a run from its last checkpoint, exactly as if it had not stopped.

A finished run that stopped early is trained further by a fit with more ``epochs``: it
goes on from the epoch it stopped at (``continue_stopped``). A rate other than the one the
checkpoint was trained at replaces it (``objects.take_new_rates``).

Rank 0's checkpoint after each epoch (``worker.loop.train``) holds the model, optimizer, LR
scheduler and gradient scaler states, the history, the callbacks' states, whether
training was asked to stop, and how many training batches were drawn so far: the position
in the stream of passes over the shard. Random state is not saved but re-derived: every
epoch reseeds the global generators from (seed, epoch, rank) (``seed_epoch``), and the
loader seeds each pass's permutations from (seed, pass, rank). A resumed epoch therefore
draws the same dropout masks and the same batches as it would have without the failure.

A checkpoint written with another number of processes (an elastic fit started again
resized) goes on with this one's: ``lr_scaling="linear"`` rates rescaled, the stream of
passes as if this size had trained from the start. A commit inside the next epoch, when
there is one, is newer still (``EpochCommits``).

All ranks load the same checkpoint: rank 0 picks the newest epoch and broadcasts it, so a
checkpoint that appears while the ranks start (a straggler of the failed attempt) cannot
split them.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import torch
import torch.distributed as dist

from ...callbacks import Callback, EarlyStopping
from ...shared.serialization import state_from_bytes
from .checkpoints import Checkpoints

log = logging.getLogger(__name__)


def seed_epoch(seed: int, epoch: int, rank: int) -> None:
    """Seed torch's (CPU and CUDA), NumPy's and Python's global generators for ``epoch``."""
    value = (seed * 1_000_003 + epoch * 7919 + rank * 104_729) % 2**32
    torch.manual_seed(value)
    np.random.seed(value)
    random.seed(value)


def agree_on_checkpoint(checkpoints: Checkpoints, rank: int, device: torch.device) -> int:
    """The epoch of the newest checkpoint according to rank 0 (0 when there is none)."""
    epochs = checkpoints.epochs() if rank == 0 else []
    flag = torch.tensor([epochs[-1] if epochs else 0], dtype=torch.int64, device=device)
    dist.broadcast(flag, src=0)
    return int(flag.item())


def load_checkpoint(checkpoints: Checkpoints, epoch: int) -> dict:
    store = checkpoints.store
    return state_from_bytes(store.read_bytes(checkpoints.path(epoch)))


def callback_states(callbacks: list[Callback]) -> list[dict]:
    return [{"type": type(cb).__qualname__, "state": cb.state_dict()} for cb in callbacks]


def restore_callbacks(callbacks: list[Callback], saved: list[dict]) -> None:
    """Give each callback its saved state, when the callbacks are the same kinds, in the
    same order, as when the checkpoint was written; otherwise they start afresh."""
    if [type(cb).__qualname__ for cb in callbacks] != [s["type"] for s in saved]:
        log.warning(
            "callbacks differ from the checkpoint's (%s); they start without saved state",
            [s["type"] for s in saved],
        )
        return
    for cb, s in zip(callbacks, saved):
        cb.load_state_dict(s["state"])


def continue_stopped(callbacks: list[Callback], epoch: int, rank: int) -> None:
    """A finished run that an early-stopping callback stopped at ``epoch`` is trained
    further: its ``EarlyStopping`` callbacks keep the best value so far and count their
    patience afresh from there, so the fit's callbacks decide when it stops again."""
    for cb in callbacks:
        if isinstance(cb, EarlyStopping):
            cb.wait, cb.stopped_epoch = 0, None
    if rank == 0:
        log.info("the run stopped early at epoch %d; trained further from there", epoch)
