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
accumulation, groups of consecutive steps share one optimizer step, and the weights make the
group's gradient the exact mean over the group's rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def shard_bounds(total_rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """The half-open row range [start, end) of ``rank``'s shard."""
    base, extra = divmod(total_rows, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


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
        self.world_size = world_size
        shard_rows = [
            end - start
            for start, end in (shard_bounds(total_rows, world_size, r) for r in range(world_size))
        ]
        self.rows = shard_rows[rank]
        self.steps = max(1, math.ceil(max(shard_rows) / batch_size))
        per_rank = [split_sizes(n, self.steps) for n in shard_rows]
        self.batch_sizes = per_rank[rank]
        # rows of each step summed over ranks: the denominator of the exact mean
        self.step_rows = [sum(sizes[s] for sizes in per_rank) for s in range(self.steps)]

    def weights(self, group: int = 1) -> list[float]:
        """Per step, the factor that turns this rank's mean loss into its share of the exact
        mean over the rows of the step's group (``group`` consecutive steps share one
        optimizer step) once DDP averages gradients over ranks (1.0 for empty steps)."""
        group_rows = []
        for start in range(0, self.steps, group):
            rows = self.step_rows[start : start + group]
            group_rows += [sum(rows)] * len(rows)
        return [
            size * self.world_size / total if size else 1.0
            for size, total in zip(self.batch_sizes, group_rows)
        ]

    def group_ends(self, group: int) -> list[bool]:
        """Per step, whether it is the last of its group (the pass's last group may be short)."""
        return [(s + 1) % group == 0 or s == self.steps - 1 for s in range(self.steps)]


def eval_sizes(rows: int, batch_size: int, max_steps: int | None) -> list[int]:
    """Batch sizes of an in-order evaluation pass (no collectives, counts may differ)."""
    sizes = [min(batch_size, rows - start) for start in range(0, rows, batch_size)]
    return sizes if max_steps is None else sizes[:max_steps]
