"""Executor: the row order of a shuffled pass, whoever cuts it into batches.

A pass reads the rank's pieces (permuted first, see ``ShardLoader``) through a shuffle buffer
of ``buffer_rows`` rows. The buffer is refilled with whole pieces until it holds at least
``buffer_rows`` rows (or the pieces run out), and each refill is permuted; the first rows
of the buffer are then served and the last ``buffer_rows // 2`` kept for the next refill
(after the last piece: none kept). Each refill (a ``Window``) depends only on the pieces'
row counts, the buffer's size and the generator, never on the batch sizes asked for: the
order of a pass is a function of (seed, pass, rank, shard, buffer size), so a pass read
again in other batch sizes (the rest of a resized epoch, ``remainder_batches``) gives the same
rows in the same order, and a shard held on the device (``DeviceShard``) takes the
order the streaming loader gives (``pass_order``). Length bucketing (``Bucketing``)
reorders each window's served rows by their lengths, again whatever the batch sizes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch

DEFAULT_BUFFER_BYTES = 256 * 2**20


def default_buffer_rows(row_bytes: int) -> int:
    """As many rows of ``row_bytes`` bytes as fit in DEFAULT_BUFFER_BYTES."""
    return max(1, DEFAULT_BUFFER_BYTES // max(1, row_bytes))


class Window(NamedTuple):
    """One refill of the buffer: ``chunks`` more pieces join the rows it kept, and the
    buffer becomes ``(kept + new rows)[perm]``; its first ``serve`` rows are served, the
    rest kept."""

    chunks: int
    perm: torch.Tensor
    serve: int


def windows(rows_of_chunks: list[int], buffer_rows: int, generator) -> Iterator[Window]:
    """The refills of a pass over chunks of ``rows_of_chunks`` rows, in order."""
    kept, taken, count = 0, 0, len(rows_of_chunks)
    while taken < count:
        rows, new = kept, 0
        while taken + new < count and rows < buffer_rows:  # kept < buffer_rows: one at least
            rows += rows_of_chunks[taken + new]
            new += 1
        taken += new
        serve = rows if taken == count else rows - buffer_rows // 2
        yield Window(new, torch.randperm(rows, generator=generator), serve)
        kept = rows - serve


def pass_order(rows_of_chunks: list[int], buffer_rows: int, generator) -> torch.Tensor:
    """The pass's rows as positions in the chunks' concatenation, in the order served."""
    starts = [0]
    for rows in rows_of_chunks:
        starts.append(starts[-1] + rows)
    served, held, taken = [], torch.empty(0, dtype=torch.int64), 0
    for window in windows(rows_of_chunks, buffer_rows, generator):
        new = torch.arange(starts[taken], starts[taken + window.chunks])
        taken += window.chunks
        held = torch.cat([held, new])[window.perm]
        served.append(held[: window.serve])
        held = held[window.serve :]
    return torch.cat(served) if served else torch.empty(0, dtype=torch.int64)
