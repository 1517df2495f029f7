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
    """Rows [start, stop) of row group ``row_group`` of file ``path`` (of the ``groups``
    row groups from ``row_group`` on, counted as one, where ``even_pieces`` joined them)."""

    path: str  # relative to the dataset folder
    row_group: int
    start: int
    stop: int
    group_rows: int  # rows in the whole row group (in all ``groups``)
    groups: int = 1

    @property
    def rows(self) -> int:
        return self.stop - self.start

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.group_rows


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


PIECE_BYTES = 16 * 2**20  # about what a piece of a table read in place reads


def even_pieces(
    pieces: list[Piece], group_bytes: dict[tuple[str, int], int], target: int | None = None
) -> list[Piece]:
    """``pieces`` re-cut to about ``target`` bytes each, for the row groups tables in a lake
    hold (``group_bytes``: each row group's uncompressed bytes of the columns read, from the
    files' footers): consecutive whole row groups of one file under ``target / 2`` are
    joined into one piece (one read for all, not one per tiny group), and a piece of a row
    group over ``2 * target`` is cut into consecutive parts, which ``piece_order`` keeps
    together and in order so a reader can decode the row group once, part after part
    (``ArrowReader``'s streams). The same rows in the same order. ``target``: PIECE_BYTES."""
    target = PIECE_BYTES if target is None else target
    out: list[Piece] = []
    joined = math.inf  # the bytes of out[-1] where it can take more whole row groups
    for piece in pieces:
        size = group_bytes.get((piece.path, piece.row_group), 0)
        last = out[-1] if out else None
        small = piece.whole and size < target / 2
        if small and last is not None and last.path == piece.path:
            # row groups between two pieces of one rank hold no rows of its split: read
            # with the piece (as joined groups are), if small too
            end = last.row_group + last.groups
            between = [group_bytes.get((piece.path, g), 0) for g in range(end, piece.row_group)]
            if joined + size + sum(between) <= target and all(b < target / 2 for b in between):
                rows = last.group_rows + piece.group_rows
                groups = piece.row_group + 1 - last.row_group
                out[-1] = Piece(piece.path, last.row_group, 0, rows, rows, groups)
                joined += size + sum(between)
                continue
        joined = size if small else math.inf
        parts = math.ceil(size * piece.rows / max(1, piece.group_rows) / target)
        if size <= 2 * target or parts < 2:
            out.append(piece)
            continue
        cuts = [piece.start + piece.rows * k // parts for k in range(parts + 1)]
        out.extend(
            Piece(piece.path, piece.row_group, lo, hi, piece.group_rows)
            for lo, hi in zip(cuts, cuts[1:])
            if lo < hi
        )
    return out


def piece_order(pieces: list[Piece], generator: torch.Generator | None) -> list[int]:
    """A pass's order of ``pieces`` (indices): with ``generator`` permuted, the parts of one
    row group (``even_pieces``) kept together and in order; else as they are."""
    units: list[list[int]] = []
    for i, piece in enumerate(pieces):
        before = pieces[i - 1] if i else None
        if before is not None and (before.path, before.row_group, before.groups) == (
            piece.path,
            piece.row_group,
            piece.groups,
        ):
            units[-1].append(i)
        else:
            units.append([i])
    if generator is None:
        return list(range(len(pieces)))
    return [i for u in torch.randperm(len(units), generator=generator).tolist() for i in units[u]]


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
