"""Executor: commits inside an epoch, so a job started again goes on from the last one.

Every ``commit_every_steps`` optimizer steps of an epoch the ranks gather what only each of
them knows, and rank 0 writes ``runs/<run_id>/commit.pt`` (atomically) with the rest. An
elastic fit's default (``COMMIT_AUTO``) commits once in the middle of the first epoch, then
``COMMITS_PER_EPOCH`` times an epoch, or less often, so that commits cost at most
``BUDGET`` of the training time (``adapted``: rank 0 times them, and after each epoch tells
every rank the next epoch's interval). A commit holds:

- the model, optimizer, LR scheduler and gradient scaler, the callbacks, the history;
- the epoch and the step within it, and the position in the stream of passes;
- per rank: its random state (torch, CUDA, NumPy, Python), its part of the epoch's sums
  (loss, metrics, rows, non-finite steps), and its rows of the epoch: the runs it reads
  (``data/remainder.py``) and how many of their rows it has trained on;
- whether each shard of the epoch's first sharding was held on the device or streamed (a
  reader of a run opens it the same way; both give the same order, ``data/shuffle.py``).

A launch whose newest epoch checkpoint is epoch ``e - 1`` and which finds a commit of epoch
``e`` resumes there. With the same number of processes it continues exactly: every rank
takes its random state and its sums back and skips the batches already trained on. With
another number, the rows of the epoch not yet trained on are re-sharded over the new
ranks (``remainder.reshard``), rank 0 takes the sums of all old ranks, and the epoch ends
on those rows; later epochs shard the data over the new ranks as usual.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist

from ...shared.serialization import state_from_bytes, state_to_bytes
from ...shared.spec import COMMIT_AUTO, TrainSpec
from ..data.loader import empty_batch, open_loader
from ..data.remainder import Run, after, remainder_batches, reshard
from ..data.shards import StepPlan

COMMITS_PER_EPOCH = 4  # commit_every_steps=COMMIT_AUTO (elastic fits' default): at most
BUDGET = 0.05  # ... and commits cost at most this share of the training time


def interval(setting: int, steps_per_epoch: int) -> int:
    """Steps between commits in the first epoch (0: none): with ``COMMIT_AUTO`` one in its
    middle, which is timed."""
    if setting == COMMIT_AUTO:
        return steps_per_epoch // 2
    return setting


def adapted(steps: int, train_s: float, commit_s: list[float], current: int) -> int:
    """``COMMIT_AUTO``'s interval for the next epoch from this one's: ``steps`` trained in
    ``train_s`` seconds, commits that took ``commit_s`` (none timed: ``current`` stays).
    ``COMMITS_PER_EPOCH`` an epoch at most, and none when one costs over ``BUDGET`` of it."""
    if not commit_s or not steps or train_s <= 0:
        return current
    commit = sum(commit_s) / len(commit_s)
    step = max(train_s - sum(commit_s), 1e-9) / steps
    least = math.ceil(commit / (BUDGET * step))
    if least >= steps:
        return 0
    return max(steps // COMMITS_PER_EPOCH, least)


def rng_state() -> dict:
    """The global generators' states as tensors and plain values (what a state file may
    hold, see ``shared/serialization.py``)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def write(store, path: str, rank: int, shared: dict, mine: dict) -> None:
    """Gather every rank's ``mine`` (a collective); rank 0 writes them with ``shared``."""
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        store.write_bytes(path, state_to_bytes({**shared, "ranks": ranks}))


def agree(store, path: str, rank: int, after_epoch: int, device: torch.device) -> dict | None:
    """The commit of epoch ``after_epoch + 1`` when rank 0 finds one, on every rank."""
    commit = None
    if rank == 0 and store.exists(path):
        commit = state_from_bytes(store.read_bytes(path))
        commit = commit if commit["epoch"] == after_epoch + 1 else None
    flag = torch.tensor([int(commit is not None)], dtype=torch.int64, device=device)
    dist.broadcast(flag, src=0)
    if not flag.item():
        return None
    return commit if rank == 0 else state_from_bytes(store.read_bytes(path))


def remaining_runs(commit: dict, world: int) -> list[list[Run]]:
    """The rows of the commit's epoch not trained on, cut over ``world`` ranks."""
    left = [after([Run(*r) for r in s["runs"]], s["consumed"]) for s in commit["ranks"]]
    return reshard(left, world)


def resharded_epoch(
    commit: dict,
    spec: TrainSpec,
    rank: int,
    world: int,
    device: torch.device,
    epoch: int,
    sources: dict,
) -> tuple[Iterator, int, list[Run]]:
    """The rest of the commit's epoch on this rank of ``world``: (batch, loss weight, last
    of its group) for each of its steps, their count, and this rank's runs. ``sources``
    says which shards of the epoch's first sharding were held on the device."""
    parts = remaining_runs(commit, world)
    plan = StepPlan.over([sum(r.rows for r in p) for p in parts], rank, spec.batch_size)
    opened: dict = {}

    def source(w: int, r: int):
        if (w, r) not in opened:
            opened[w, r] = open_loader(
                spec, "train", w, r, False, device if sources[w, r] else None
            )
        return opened[w, r]

    empty = empty_batch(spec, "train")
    batches = remainder_batches(parts[rank], plan.batch_sizes, epoch, source, empty)
    weights = plan.schedule(spec.loop.backward_passes_per_step, plan.steps)
    stream = ((b, w, last) for b, (w, last) in zip(batches, weights))
    return stream, plan.steps, parts[rank]


def resumed_sums(commit: dict, rank: int, world: int) -> tuple[list[float], int | None]:
    """The part of the epoch's sums this rank resumes with: its own with the same number of
    ranks; else rank 0 all of them (first bad step: the smallest), the others none."""
    saved = commit["ranks"]
    if len(saved) == world:
        return saved[rank]["sums"], saved[rank]["first_bad"]
    if rank != 0:
        return [0.0] * len(saved[0]["sums"]), None
    total = [sum(values) for values in zip(*(s["sums"] for s in saved))]
    bad = [s["first_bad"] for s in saved if s["first_bad"] is not None]
    return total, min(bad) if bad else None
