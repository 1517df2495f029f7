"""Executor: commits inside an epoch, so a job started again goes on from the last one.

Every ``commit_every_steps`` optimizer steps of an epoch (not batches: with
``backward_passes_per_step = k`` a step is a group of k batches) the ranks gather what only
each of them knows, and rank 0 writes ``runs/<run_id>/commit.pt`` (atomically) with the
rest. A commit is made only after a batch that ends an optimizer step, never inside a
group (its accumulated gradients are in no commit), and never after the epoch's last step
(the epoch's checkpoint is written then). An elastic fit's default (``COMMIT_AUTO``)
commits once in the middle of the first epoch, timed, then every epoch at an interval
``adapted`` to the last epoch's timings (rank 0 times the commits, and after each epoch
tells every rank the next epoch's interval): as often as keeps commits under ``BUDGET`` of
the training time, bounded by a floor (``COMMITS_PER_EPOCH`` an epoch at most) and a
ceiling (once an epoch, in its middle, at least). The ceiling keeps commits coming: a
commit that cost more than the budget (a model whose state is large against its epoch, or
a store slow for a moment) is still made once an epoch and timed again, so an elastic fit
never loses more than about half an epoch, at the cost of at most one write an epoch
besides the epoch's checkpoint, which holds the same state. A commit holds:

- the model, optimizer, LR scheduler and gradient scaler, the callbacks, the history;
- the epoch and the batches of it trained (``step``: the end of an optimizer step), and
  the position in the stream of passes;
- per rank: its random state (torch, CUDA, NumPy, Python), its part of the epoch's sums
  (loss, metrics, rows, non-finite steps), and its rows of the epoch: the runs it reads
  (``worker.data.remainder``) and how many of their rows it has trained on;
- whether each shard of the epoch's first sharding was held on the device or streamed (a
  reader of a run opens it the same way; both give the same order, ``pass_order``).

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
import time
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist

from ...shared.serialization import state_from_bytes, state_to_bytes
from ...shared.spec import COMMIT_AUTO, TrainSpec
from ..data.device_shard import DeviceShard
from ..data.loader import empty_batch, open_loader
from ..data.remainder import Run, after, own_runs, remainder_batches, reshard
from ..data.shards import StepPlan

COMMITS_PER_EPOCH = 4  # commit_every_steps=COMMIT_AUTO (elastic fits' default): at most
BUDGET = 0.05  # ... and as often as keeps commits under this share of the training time


def optimizer_steps(batches: int, group: int) -> int:
    """The optimizer steps of an epoch of ``batches`` in groups of ``group`` (the last one
    may be short, ``StepPlan.schedule``)."""
    return -(-batches // group)


def middle(steps: int) -> int:
    """The interval that commits once in an epoch of ``steps`` optimizer steps, after its
    middle one (none in an epoch of one step: its end is the epoch's checkpoint)."""
    return max(1, (steps + 1) // 2)


def interval(setting: int, steps_per_epoch: int) -> int:
    """Optimizer steps between commits in the first epoch of ``steps_per_epoch`` optimizer
    steps (0: none): ``setting``, or with ``COMMIT_AUTO`` one in its ``middle``, timed."""
    if setting == COMMIT_AUTO:
        return middle(steps_per_epoch)
    return setting


def adapted(
    steps: int,
    train_s: float,
    commit_s: list[float],
    current: int,
    epoch_steps: int | None = None,
) -> int:
    """``COMMIT_AUTO``'s interval for the next epoch from this one's: ``steps`` optimizer
    steps trained in ``train_s`` seconds, commits that took ``commit_s`` (none timed:
    ``current`` stays). As often as keeps commits under ``BUDGET``, but at most
    ``COMMITS_PER_EPOCH`` and at least once an epoch of ``epoch_steps`` optimizer steps
    (default ``steps``; less were trained in an epoch a launch went on with from a commit):
    never 0, so a commit that cost too much once is made and timed again."""
    if not commit_s or not steps or train_s <= 0:
        return current
    epoch_steps = epoch_steps or steps
    commit = sum(commit_s) / len(commit_s)
    step = max(train_s - sum(commit_s), 1e-9) / steps
    least = math.ceil(commit / (BUDGET * step))
    floor = max(1, epoch_steps // COMMITS_PER_EPOCH)
    return min(max(floor, least), middle(epoch_steps))


def rng_state() -> dict:
    """The global generators' states as tensors and plain values (what a state file may
    hold, see ``state_from_bytes``)."""
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


class EpochCommits:
    """Commits inside an epoch, as the training loop makes and resumes them (a mixin of
    the loop): the interval, the commit to go on from, this epoch's rows and runs."""

    def _open_commits(self) -> None:
        """The commit to resume from (one of this launch's size, or whose rows can be
        re-sharded), restored; the interval in optimizer steps (an epoch's batches form
        groups of backward_passes_per_step); the counts reported."""
        spec, rank = self.spec, self.info.rank
        self.commit_path = spec.store.run(spec.run_id).step_commit
        self.group = spec.loop.backward_passes_per_step
        self.epoch_optimizer_steps = optimizer_steps(self.steps_per_epoch, self.group)
        self.every = interval(spec.loop.commit_every_steps, self.epoch_optimizer_steps)
        self.commit_s: list[float] = []  # this epoch's commits' seconds (rank 0's)
        self.commits_made, self.commit_seconds = 0, 0.0
        self.commit = None
        if spec.loop.commit_every_steps:
            self.commit = agree(spec.store, self.commit_path, rank, self.start_epoch, self.device)
        if self.commit is not None and not self._can_reshard(self.commit):
            self.commit = None  # the epoch's checkpoint is where this size can go on from
        self.resumed_commit = None  # {"epoch", "step"} of the commit this launch went on from
        if self.commit is not None:
            self._restore(self.commit)
            self.resumed_commit = {"epoch": self.commit["epoch"], "step": self.commit["step"]}
        self.epoch_runs, self.epoch_rows, self.resharded, self.sources = [], 0, False, None

    def _can_reshard(self, commit: dict) -> bool:
        """Whether this launch can go on from ``commit``: with its number of processes, or
        with another when an epoch is one pass (its rows can be re-sharded)."""
        same = commit["world_size"] == self.info.world_size and not commit["resharded"]
        return same or self.spec.loader.train_steps_per_epoch is None

    def _epoch_batches(self, epoch: int, sums) -> tuple:
        """Where the epoch's batches come from: (stream, steps already done, steps to do).
        Normally the stream of passes, all ``steps_per_epoch``; in the epoch of a commit
        the rest of it (``resharded_epoch``): the same stream after the commit's step, or the rows
        not yet trained on, re-sharded over this launch's ranks."""
        rank, world = self.info.rank, self.info.world_size
        commit, self.commit = self.commit, None
        self.epoch_rows = 0
        if commit is None:
            self.epoch_runs = own_runs(self.spec.data.rows("train"), world)[rank]
            self.resharded, self.sources = False, None
            return self.steps, 0, self.steps_per_epoch
        sums.resume(*resumed_sums(commit, rank, world))
        saved = commit["ranks"]
        self.sources = commit["sources"] or {
            (len(saved), r): s["held"] for r, s in enumerate(saved)
        }
        if commit["world_size"] == world and not commit["resharded"]:
            set_rng_state(saved[rank]["rng"])
            self.epoch_runs = [tuple(r) for r in saved[rank]["runs"]]
            self.epoch_rows = saved[rank]["consumed"]
            self.resharded = False
            return self.steps, commit["step"], self.steps_per_epoch - commit["step"]
        self.resharded = True
        stream, steps, self.epoch_runs = resharded_epoch(
            commit, self.spec, rank, world, self.device, epoch, self.sources
        )
        return stream, 0, steps

    def _commit(self, epoch: int, step: int, sums) -> None:
        """Commit the training state after ``step`` of ``epoch`` (``sums``: the epoch's
        ``EpochSums`` so far)."""
        began = time.perf_counter()
        values, first_bad = sums.partial()
        mine = {
            "rng": rng_state(),
            "sums": values,
            "first_bad": first_bad,
            "runs": [tuple(run) for run in self.epoch_runs],
            "consumed": self.epoch_rows,
            "held": isinstance(self.data.train, DeviceShard),
        }
        shards = self._save_shards("commit") if self.sharded else None
        shared = {}
        if self.info.rank == 0:
            shared = {
                **self._state(False, shards),
                "epoch": epoch,
                "step": step,
                "resharded": self.resharded,
                "sources": self.sources,
            }
        if self.tensorboard is not None:  # the step points up to here, kept by a resume
            self.tensorboard.flush()
        write(self.spec.store, self.commit_path, self.info.rank, shared, mine)
        if shards is not None and self.info.rank == 0:  # the commit it replaced
            self._remove_shards("commit-", keep=shards)
        self.commit_s.append(time.perf_counter() - began)
        self.commits_made += 1
        self.commit_seconds += self.commit_s[-1]
