"""Executor: one Spark partition of a materialization -> at most one Parquet file per split.

``write_partition`` is what the driver's ``materialize`` runs with ``mapInArrow``: it receives
the partition's rows (the converted columns and the split column) as Arrow record batches
and writes each split's rows, in the order they arrive, to
``datasets/<key>/<write-id>/<split>/part-<partition>.parquet`` (``DatasetFolder.part``) with
pyarrow, through the store's fsspec filesystem: any store works on every executor with its
own ``storage_options``. A split with no rows in the partition gets no file.

Float columns are written without dictionary encoding (``dictionary_columns``).
Row groups hold about ``row_group_bytes`` of (uncompressed) Arrow data: a split's rows are
buffered and cut into a row group whenever the buffer reaches that size. Each file is
written under a hidden temporary name and moved to its name when complete
(``Store.open_atomic``), so a failed, retried or speculative task attempt never leaves a
partial file; every attempt of a partition writes the same names.

It yields one row per file written (``WRITTEN_SCHEMA``): the split, the path relative to
the dataset folder, the rows of each row group, which the driver records in
``_meta.json`` without reading any footer back, and the counts of the value checks over
the file's rows (``column_stats``, as JSON), which the driver merges and checks; with them,
where the rows come with their hash (``row_digest.HASH_COL``, not written), the sum of the
file's row hashes (``row_hashes``), from which the driver makes the dataset's content
digest. Class indices that come as floats are written as int64 (``as_written``), once
counted.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyspark import TaskContext

from ...shared.column_stats import CheckedColumn, as_written, column_stats, merge_stats
from ...shared.row_digest import HASH_COL, row_hashes
from ...shared.spec import SPLITS
from ...store import DatasetFolder, Store

WRITTEN_SCHEMA = "split string, path string, row_groups array<bigint>, stats string"
_WRITTEN = pa.schema(
    [
        ("split", pa.string()),
        ("path", pa.string()),
        ("row_groups", pa.list_(pa.int64())),
        ("stats", pa.string()),
    ]
)


@dataclass(frozen=True)
class ParquetTarget:
    """Where and how a materialization's partitions are written (pickled to executors)."""

    store: Store
    dataset: DatasetFolder  # the returned paths are relative to its folder
    write_id: str  # the write whose files are written
    split_col: str  # the column holding each row's split; not written
    row_group_bytes: int
    compression: str  # uncompressed, snappy, gzip or zstd
    checked: tuple[CheckedColumn, ...] = ()  # the columns whose values are counted
    hashed: bool = False  # the rows come with their hash (HASH_COL): summed, not written

    def path(self, split: str, partition: int) -> str:
        return self.dataset.part(self.write_id, split, partition)


class RowGroupBuffer:
    """Tables of one split, cut into row groups of about ``row_group_bytes``.

    ``add`` returns the row groups completed by the new rows; ``rest`` the remaining rows.
    Sizes are Arrow's in-memory sizes of the incoming tables, so the rows of a group are
    ``row_group_bytes`` divided by the buffer's average bytes per row (at least one).
    """

    def __init__(self, row_group_bytes: int):
        self.target = row_group_bytes
        self.tables: list[pa.Table] = []
        self.rows = 0
        self.bytes = 0.0

    def add(self, table: pa.Table) -> list[pa.Table]:
        self.tables.append(table)
        self.rows += table.num_rows
        self.bytes += table.nbytes
        groups = []
        while self.rows and self.bytes >= self.target:
            per_row = self.bytes / self.rows
            take = min(self.rows, max(1, int(self.target // per_row)))
            buffered = pa.concat_tables(self.tables)
            groups.append(buffered.slice(0, take))
            self.tables = [buffered.slice(take)]
            self.rows -= take
            self.bytes = self.rows * per_row
        return groups

    def rest(self) -> pa.Table | None:
        return pa.concat_tables(self.tables) if self.rows else None


def _split_tables(batch: pa.RecordBatch, split_col: str) -> Iterator[tuple[str, pa.Table]]:
    """(split, its rows without the split column) for each split present in ``batch``."""
    table = pa.Table.from_batches([batch])
    data = table.select([n for n in table.column_names if n != split_col])
    for split in SPLITS:
        mask = pc.equal(table.column(split_col), split)
        count = pc.sum(mask).as_py() or 0
        if count == table.num_rows:
            yield split, data
        elif count:
            yield split, data.filter(mask)


class PartitionWriter:
    """Writes the rows of partition ``partition`` to one file per split (see the module)."""

    def __init__(self, target: ParquetTarget, partition: int):
        self.target, self.partition = target, partition

    def write(self, batches: Iterator[pa.RecordBatch]) -> list[tuple[str, str, list[int], dict]]:
        """Every batch's rows; returns (split, path relative to the dataset, row groups,
        the counts of the value checks) per file."""
        buffers = {s: RowGroupBuffer(self.target.row_group_bytes) for s in SPLITS}
        writers: dict[str, pq.ParquetWriter] = {}
        groups: dict[str, list[int]] = {s: [] for s in SPLITS}
        stats: dict[str, dict[str, int]] = {s: {} for s in SPLITS}
        checked = list(self.target.checked)
        with ExitStack() as files:  # closes every writer, then moves (or removes) its file

            def write_group(split: str, table: pa.Table) -> None:
                if split not in writers:
                    writers[split] = self._open(files, split, table.schema)
                writers[split].write_table(table, row_group_size=table.num_rows)
                groups[split].append(table.num_rows)

            for batch in batches:
                if batch.num_rows:
                    for split, table in _split_tables(batch, self.target.split_col):
                        counts = column_stats(table, checked)
                        if self.target.hashed:
                            counts.update(row_hashes(table))
                            table = table.remove_column(table.column_names.index(HASH_COL))
                        stats[split] = merge_stats(stats[split], counts)
                        for group in buffers[split].add(as_written(table, checked)):
                            write_group(split, group)
            for split, buffer in buffers.items():
                if (rest := buffer.rest()) is not None:
                    write_group(split, rest)
        root = self.target.dataset.path
        return [
            (s, posixpath.relpath(self.target.path(s, self.partition), root), g, stats[s])
            for s, g in groups.items()
            if g
        ]

    def _open(self, files: ExitStack, split: str, schema: pa.Schema) -> pq.ParquetWriter:
        sink = files.enter_context(
            self.target.store.open_atomic(self.target.path(split, self.partition))
        )
        codec = self.target.compression
        codec = "none" if codec == "uncompressed" else codec
        writer = pq.ParquetWriter(
            sink, schema, compression=codec, use_dictionary=dictionary_columns(schema)
        )
        return files.enter_context(writer)


def dictionary_columns(schema: pa.Schema) -> list[str]:
    """The columns worth dictionary encoding: the top-level non-float scalars (class
    labels, weights stored as integers). Float values rarely repeat, so pyarrow would
    build a dictionary only to drop it: twice the write time, and larger files."""
    return [
        f.name for f in schema if not (pa.types.is_floating(f.type) or pa.types.is_nested(f.type))
    ]


def write_partition(
    batches: Iterator[pa.RecordBatch], target: ParquetTarget
) -> Iterator[pa.RecordBatch]:
    """The ``mapInArrow`` function: writes this task's partition, yields ``WRITTEN_SCHEMA``
    rows (one per file)."""
    written = PartitionWriter(target, TaskContext.get().partitionId()).write(batches)
    rows = [
        {"split": s, "path": p, "row_groups": g, "stats": json.dumps(c)} for s, p, g, c in written
    ]
    yield pa.RecordBatch.from_pylist(rows, schema=_WRITTEN)
