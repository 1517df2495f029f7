"""Executor: this rank's share of a materialized dataset, as tensors, in seeded batches.

Sharding is by rows, not files: the rows of a split, in (file, row group) order, are cut
into ``world_size`` contiguous ranges whose sizes differ by at most one. Each rank reads only
the row groups overlapping its range. Every row is used exactly once per epoch across ranks.

Training steps are agreed without communication: every rank knows every shard's size, so
all ranks take ``steps = ceil(max_shard / batch_size)`` steps, each splitting its shard
into ``steps`` near-equal batches. The rows in one step across all ranks are known too,
which lets the training loop weight each rank's loss so DDP's gradient average is the exact
mean over the step's rows, even when batches differ in size.
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ..spec import DatasetInfo
from ..store import Store
from .convert import column_to_tensor


def shard_bounds(total_rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """The half-open row range [start, end) of ``rank``'s shard."""
    base, extra = divmod(total_rows, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def split_sizes(rows: int, parts: int) -> list[int]:
    """``rows`` cut into ``parts`` sizes that differ by at most one, larger first."""
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def read_shard(
    store: Store, data: DatasetInfo, split: str, world_size: int, rank: int
) -> dict[str, torch.Tensor]:
    """Read this rank's rows of ``split`` into one tensor per feature and label column."""
    start, end = shard_bounds(data.rows(split), world_size, rank)
    columns = data.features + data.labels
    pieces: list[pa.Table] = []
    offset = 0
    for rel_path, groups in data.files.get(split, []):
        file_rows = sum(groups)
        if offset + file_rows <= start or offset >= end:
            offset += file_rows
            continue
        with store.fs.open(posixpath.join(data.path, rel_path), "rb") as f:
            parquet = pq.ParquetFile(f)
            for index, group_rows in enumerate(groups):
                lo, hi = max(start, offset), min(end, offset + group_rows)
                if lo < hi:
                    table = parquet.read_row_group(index, columns=[c.name for c in columns])
                    pieces.append(table.slice(lo - offset, hi - lo))
                offset += group_rows
    if pieces:
        table = pa.concat_tables(pieces)
    else:
        table = pa.table({c.name: pa.array([], type=pa.float32()) for c in columns})
    return {c.name: column_to_tensor(c.name, table.column(c.name), c.torch_dtype) for c in columns}


class TrainBatches:
    """Seeded, shuffled batches of row indices for one rank, equal step counts on all ranks."""

    def __init__(self, total_rows: int, world_size: int, rank: int, batch_size: int, seed: int):
        self.world_size, self.rank, self.seed = world_size, rank, seed
        shards = [shard_bounds(total_rows, world_size, r) for r in range(world_size)]
        shard_rows = [end - start for start, end in shards]
        self.rows = shard_rows[rank]
        self.steps = max(1, math.ceil(max(shard_rows) / batch_size))
        per_rank = [split_sizes(n, self.steps) for n in shard_rows]
        self.batch_sizes = per_rank[rank]
        # rows of each step summed over ranks: the denominator of the exact mean
        self.step_rows = [sum(sizes[s] for sizes in per_rank) for s in range(self.steps)]

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, float]]:
        """Yield (row indices, loss weight) per step; weights make DDP's average exact."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch * 7919 + self.rank)
        order = torch.randperm(self.rows, generator=generator)
        start = 0
        for size, total in zip(self.batch_sizes, self.step_rows):
            yield order[start : start + size], size * self.world_size / total
            start += size


def eval_batches(rows: int, batch_size: int) -> Iterator[torch.Tensor]:
    """Row indices of in-order evaluation batches (no collectives, counts may differ)."""
    for start in range(0, rows, batch_size):
        yield torch.arange(start, min(rows, start + batch_size))
