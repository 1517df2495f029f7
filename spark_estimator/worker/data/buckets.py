"""Executor: length bucketing, each shuffle window's served rows regrouped by length.

With ``bucket_by_length`` a training pass still goes through the shuffle buffer's refills
(``shuffle.windows``), and every row is served once, by the same window as without it;
only the order of each window's served rows changes: they are sorted by length (stably, so
rows of one length keep the window's random order), cut into groups of ``group_rows``
consecutive rows (``BUCKET_BATCHES`` batches of ``batch_size``), and the groups are served
in a random order. A batch then holds rows of similar lengths and pads little, while the
order of the lengths over the pass stays random.

A row's length is the sum over the measured columns (feature and label sequences: the
length of the row's array; strings: their characters). The groups' order comes from a
generator seeded by (seed, pass, rank, window index), and the window is fixed by the
buffer's size: the order of a pass stays a function of (seed, pass, rank, shard, buffer
size, batch_size), never of the batch sizes a pass is cut into, so the rest of a resized
epoch (``remainder_batches``) reads the rows again in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .columns import RAW_TYPES, Columns

BUCKET_BATCHES = 8  # batches of batch_size rows per group of similar lengths
_TAG = 0x6B75  # keeps the groups' generator apart from other generators of the same seed


class Bucketing:
    """How one rank's loader regroups each window's served rows (see the module):
    ``columns`` the variable columns measured, groups of ``group_rows`` rows."""

    def __init__(self, columns: Sequence[str], group_rows: int, seed: int, rank: int):
        if not columns:
            raise ValueError("bucket_by_length: no sequence or string column to measure")
        self.columns, self.group_rows = list(columns), max(1, group_rows)
        self.seed, self.rank = seed, rank

    def lengths(self, rows: Columns) -> np.ndarray:
        """Each row's length: the sum of its measured columns' lengths."""
        total = np.zeros(rows.rows, dtype=np.int64)
        for name in self.columns:
            values = rows[name].tolist()
            try:
                total += np.array(list(map(len, values)), dtype=np.int64)
            except TypeError:  # a null row (unchecked Parquet): decoding names it
                total += np.array([0 if v is None else len(v) for v in values], dtype=np.int64)
        return total

    def order(self, rows: Columns, pass_index: int, window: int) -> np.ndarray:
        """The positions of ``rows`` (window ``window``'s served rows, in their served
        order) in the order served with bucketing."""
        return group_order(self.lengths(rows), self.group_rows, self.generator(pass_index, window))

    def generator(self, pass_index: int, window: int) -> np.random.Generator:
        seed = self.seed % 2**64  # SeedSequence takes no negative numbers
        return np.random.default_rng([_TAG, seed, pass_index, self.rank, window])

    def regroup(self, rows: Columns, pass_index: int, window: int) -> None:
        """Put ``rows`` (views of the pool's rows) in bucketed order, in place."""
        if rows.rows > 1:
            permute_rows(rows, self.order(rows, pass_index, window))


def group_order(lengths: np.ndarray, group_rows: int, generator: np.random.Generator):
    """Positions: ``lengths`` sorted (stably), cut into groups of ``group_rows``, the
    groups in the order of a permutation drawn from ``generator``."""
    by_length = np.argsort(lengths, kind="stable")
    groups = -(-len(by_length) // group_rows)
    starts = generator.permutation(groups) * group_rows
    return np.concatenate([by_length[s : s + group_rows] for s in starts]) if groups else by_length


def permute_rows(rows: Columns, order: np.ndarray) -> None:
    """``rows[:] = rows[order]`` for every block, other column and object array (views of
    a pool), copied in NumPy where it has the dtype (``columns.place``'s reasons)."""
    for part in rows.parts():
        if isinstance(part, RAW_TYPES):  # object arrays, BinaryRows
            part[...] = part[order]
            continue
        try:
            values = part.numpy()
        except (TypeError, RuntimeError):  # dtypes NumPy lacks (bfloat16)
            part.copy_(part.index_select(0, torch.from_numpy(order)))
            continue
        values[...] = values[order]


def measured_columns(columns) -> list[str]:
    """The feature and label columns whose lengths bucketing measures (``ColumnSpec``s):
    sequences (arrays of varying length) and strings."""
    return [c.name for c in columns if c.kind in ("sequence", "string")]
