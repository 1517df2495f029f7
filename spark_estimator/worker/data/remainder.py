"""Executor: the rest of an epoch after a resize, re-sharded over the new processes.

An epoch's rows reach each rank as a list of *runs*: rows ``[start, stop)`` of the order in
which rank ``rank`` of a ``world``-process job reads its shard in that epoch's pass (the
same seeded order on every attempt, held or streamed, whatever the batch sizes it is read
in: see the ``shuffle`` module). Normally a rank has one run, its
own whole shard (``own_runs``). A commit inside an epoch (``EpochCommits``) records
every rank's runs and how many of their rows it had trained on. When the job starts again
with another number of processes, the rows not yet trained on, rank after rank, are cut
into ``world`` contiguous parts of near-equal size (``reshard``), so no row of the epoch is
repeated or skipped; each new rank reads its part's runs again from loaders of the shards
that made them (``remainder_batches``) and trains on them in batches of a step plan over the parts'
sizes (``shards.StepPlan.over``). Runs always name the epoch's first sharding, so a second
resize within the same epoch cuts the runs again.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np
import torch

from .binary_rows import BinaryRows
from .columns import RAW_TYPES
from .convert import Tensors, chunk_rows
from .shards import shard_rows


class Run(NamedTuple):
    """Rows [start, stop) of rank ``rank``'s pass order in a ``world``-process job."""

    world: int
    rank: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def own_runs(total_rows: int, world: int) -> list[list[Run]]:
    """Every rank's runs of an epoch not resized: its whole shard."""
    return [[Run(world, r, 0, shard_rows(total_rows, world, r))] for r in range(world)]


def after(runs: list[Run], consumed: int) -> list[Run]:
    """``runs`` without their first ``consumed`` rows."""
    left = []
    for run in runs:
        skip = min(consumed, run.rows)
        consumed -= skip
        if run.start + skip < run.stop:
            left.append(Run(run.world, run.rank, run.start + skip, run.stop))
    return left


def reshard(remaining: list[list[Run]], world: int) -> list[list[Run]]:
    """The rows of ``remaining`` (per old rank, in rank order) cut into ``world`` contiguous
    parts whose sizes differ by at most one."""
    flat = [run for runs in remaining for run in runs]
    total = sum(run.rows for run in flat)
    base, extra = divmod(total, world)
    parts: list[list[Run]] = []
    for r in range(world):
        size = base + (1 if r < extra else 0)
        part: list[Run] = []
        while size:
            run = flat[0]
            take = min(size, run.rows)
            part.append(Run(run.world, run.rank, run.start, run.start + take))
            size -= take
            if take == run.rows:
                flat.pop(0)
            else:
                flat[0] = Run(run.world, run.rank, run.start + take, run.stop)
        parts.append(part)
    return parts


def remainder_batches(
    runs: list[Run],
    sizes: list[int],
    pass_index: int,
    open_source: Callable[[int, int], object],
    template: Tensors,
) -> Iterator[Tensors]:
    """Batches of ``sizes`` rows from ``runs``: each run's rows read again, in their order,
    from ``open_source(world, rank)`` (a loader of that shard, as the epoch's first
    sharding read it), then cut to the sizes. A batch of 0 rows is ``template``'s."""
    pieces = _run_rows(runs, pass_index, open_source, max(sizes, default=0) or 1)
    pending: list[Tensors] = []
    held = 0
    for size in sizes:
        while held < size:
            piece = next(pieces)
            pending.append(piece)
            held += chunk_rows(piece)
        if size == 0:
            yield {
                k: v.copy() if isinstance(v, RAW_TYPES) else v.clone() for k, v in template.items()
            }
            continue
        joined = {k: _cat([p[k] for p in pending]) for k in pending[0]}
        yield {k: v[:size] for k, v in joined.items()}
        rest = {k: v[size:] for k, v in joined.items()}
        held -= size
        pending = [rest] if held else []


def _cat(parts: list):
    """Rows of tensors, or of a variable column's rows, one after the other."""
    if isinstance(parts[0], BinaryRows):
        return BinaryRows.concatenate(parts)
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    return torch.cat(parts)


def _run_rows(runs, pass_index, open_source, step: int) -> Iterator[Tensors]:
    """Each run's rows in pieces of at most ``step`` rows: its loader's pass read up to the
    run's end in such pieces, those before its start dropped. A pass's order does not
    depend on the sizes it is read in (the ``shuffle`` module), and no piece is larger than a
    batch, so the loader's buffer stays its usual size."""
    for run in runs:
        loader = open_source(run.world, run.rank)
        before, rows = _pieces(run.start, step), _pieces(run.rows, step)
        batches = loader.batches(before + rows, pass_index)
        yield from itertools.islice(batches, len(before), None)


def _pieces(rows: int, step: int) -> list[int]:
    whole, rest = divmod(rows, step)
    return [step] * whole + ([rest] if rest else [])
