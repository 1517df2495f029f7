"""Executor: which rows each rank reads and how many steps every rank takes (no I/O).

Sharding is by rows, not files: the rows of a split, in (file, row group) order, are cut
into ``world_size`` contiguous ranges whose sizes differ by at most one. A rank's range is a
list of pieces, each a slice of one row group, so a rank reads only the row groups that
overlap its range. Every row belongs to exactly one rank.

Training steps are agreed without communication: every rank knows every shard's size, so
all ranks take ``steps = ceil(max_shard / batch_size)`` steps per pass, each cutting its
shard into ``steps`` near-equal batches. The rows in one step across all ranks are known
too, which lets the loop weight each rank's loss so DDP's gradient average is the exact mean
over the step's rows, even when batches differ in size (or are empty). With gradient
accumulation, groups of consecutive batches of an epoch share one optimizer step (a group
may span two passes; an epoch's last group may be short), and the weights make the group's
gradient the exact mean over the group's rows.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch


def pass_generator(seed: int, pass_index: int, rank: int) -> torch.Generator:
    """The generator of one pass's shuffle on one rank (piece order, then rows)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + pass_index * 7919 + rank)


def shard_bounds(total_rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """The half-open row range [start, end) of ``rank``'s shard."""
    base, extra = divmod(total_rows, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def shard_rows(total_rows: int, world_size: int, rank: int) -> int:
    """How many rows ``rank``'s shard holds."""
    start, end = shard_bounds(total_rows, world_size, rank)
    return end - start


def split_sizes(rows: int, parts: int) -> list[int]:
    """``rows`` cut into ``parts`` sizes that differ by at most one, larger first."""
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of row group ``row_group`` of file ``path``."""

    path: str  # relative to the dataset folder
    row_group: int
    start: int
    stop: int
    group_rows: int  # rows in the whole row group

    @property
    def rows(self) -> int:
        return self.stop - self.start


def shard_pieces(files: list[tuple[str, list[int]]], world_size: int, rank: int) -> list[Piece]:
    """The pieces of row groups holding ``rank``'s rows of a split, in file order."""
    total = sum(sum(groups) for _, groups in files)
    start, end = shard_bounds(total, world_size, rank)
    pieces, offset = [], 0
    for path, groups in files:
        for index, group_rows in enumerate(groups):
            lo, hi = max(start, offset), min(end, offset + group_rows)
            if lo < hi:
                pieces.append(Piece(path, index, lo - offset, hi - offset, group_rows))
            offset += group_rows
    return pieces


class StepPlan:
    """Batch sizes of one pass over a rank's training shard, equal step counts on all ranks."""

    def __init__(self, total_rows: int, world_size: int, rank: int, batch_size: int):
        rows = [shard_rows(total_rows, world_size, r) for r in range(world_size)]
        self._cut(rows, rank, batch_size)

    @classmethod
    def over(cls, rows: list[int], rank: int, batch_size: int) -> StepPlan:
        """The plan of shards of ``rows`` rows per rank (the rest of a resized epoch)."""
        plan = cls.__new__(cls)
        plan._cut(rows, rank, batch_size)
        return plan

    def _cut(self, rows: list[int], rank: int, batch_size: int) -> None:
        self.world_size = len(rows)
        self.rows = rows[rank]
        self.steps = max(1, math.ceil(max(rows) / batch_size))
        per_rank = [split_sizes(n, self.steps) for n in rows]
        self.batch_sizes = per_rank[rank]
        # rows of each step summed over ranks: the denominator of the exact mean
        self.step_rows = [sum(sizes[s] for sizes in per_rank) for s in range(self.steps)]

    def schedule(
        self, group: int, epoch_steps: int, start: int = 0
    ) -> Iterator[tuple[float, bool]]:
        """Per batch, pass after pass, no end, from batch ``start`` on: (loss weight, last of
        its group). Batches are cut into epochs of ``epoch_steps`` and each epoch into groups
        of ``group`` consecutive batches (one optimizer step each), whatever the pass
        boundaries; an epoch's last group may be short, so every epoch ends with an optimizer
        step. The weight turns this rank's mean loss into its share of the exact mean over
        the rows of the batch's group once DDP averages gradients over ranks (1.0 for empty
        batches)."""
        for epoch_start in itertools.count(start - start % epoch_steps, epoch_steps):
            for group_start in range(epoch_start, epoch_start + epoch_steps, group):
                group_end = min(group_start + group, epoch_start + epoch_steps)
                positions = [b % self.steps for b in range(group_start, group_end)]
                rows = sum(self.step_rows[p] for p in positions)
                for b, p in zip(range(group_start, group_end), positions):
                    if b >= start:
                        size = self.batch_sizes[p]
                        yield size * self.world_size / rows if size else 1.0, b == group_end - 1


def eval_sizes(rows: int, batch_size: int, max_steps: int | None) -> list[int]:
    """Batch sizes of an in-order evaluation pass (no collectives, counts may differ)."""
    sizes = [min(batch_size, rows - start) for start in range(0, rows, batch_size)]
    return sizes if max_steps is None else sizes[:max_steps]
