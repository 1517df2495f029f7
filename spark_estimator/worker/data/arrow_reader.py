"""Executor: read pieces of Parquet row groups with pyarrow, in background threads.

``ArrowReader.chunks(pieces)`` yields one dict of NumPy arrays per piece, in the order given,
while up to ``num_workers`` further pieces are read and converted in a thread pool, so
reading overlaps the training step (pyarrow releases the GIL while it decodes; each piece
is decoded in its thread, not handed on to Arrow's own pool: measured 2.6-3.5 us of CPU a
7 KB binary row against 3.6-5.1, with the Store's files memory-mapped); a
``prepare`` function given to ``chunks`` (the loader's layout) runs on each chunk in those
threads too. Footers are parsed once per file and shared by the threads.

The pieces are decoded into memory from Arrow's jemalloc pool where pyarrow has one
(``read_pool``), not its default pool: mimalloc, the default of current pyarrow (25), gives
freed pages back to the system after 10 ms, so each piece's buffers (several MiB: the pages
decompressed, then the values) were faulted in fresh, zeroed by the kernel, at every read;
jemalloc keeps them about a second (its decay) and the next piece reuses them. Measured in
a rank's pass with 2 decode workers (the decode pool benchmark's JPEGs): the reader
threads' CPU 15-26% less at batches of 64 to 1,024 rows. The pool is chosen for these
readers only: the process's default pool is left as it is.
"""

from __future__ import annotations

import functools
import inspect
import posixpath
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyarrow._parquet import ParquetReader

from ...shared.column_stats import CheckedColumn, check_observed, column_stats
from ...shared.row_split import RowSplit
from ...shared.spec import ColumnSpec, InPlace, column_param
from ...store import Store
from . import shards
from .convert import class_indices, column_to_numpy, numpy_dtype, variable_rows
from .shards import Piece

Chunk = dict[str, np.ndarray]  # one piece's columns as read (maybe read-only Arrow memory)
ROW_ID = "__spark_estimator_row"  # a chunk's rows' indices in their split (row_offsets)


def row_offsets(files: list[tuple[str, list[int]]]) -> dict[tuple[str, int], int]:
    """The index in the split of the first row of each (file, row group) of ``files``."""
    offsets, at = {}, 0
    for path, groups in files:
        for index, rows in enumerate(groups):
            offsets[path, index] = at
            at += rows
    return offsets


def table_to_chunk(table, columns: list[ColumnSpec]) -> Chunk:
    """Whole Arrow columns to NumPy, one vectorized conversion per column, zero-copy where
    Arrow allows (the arrays may be read-only; the loader copies them once, into its buffer);
    ML vectors are decoded into their column's dtype; a variable column's rows become
    ``BinaryRows`` (binary, string) or an array of Python objects (``variable_rows``)."""
    chunk = {
        c.name: variable_rows(c, table.column(c.name))
        if c.variable
        else column_to_numpy(c.name, table.column(c.name), numpy_dtype(c.torch_dtype))
        for c in columns
    }
    for c in columns:
        if c.integral and chunk[c.name].dtype.kind == "f":  # float labels read as classes
            chunk[c.name] = class_indices(c.name, chunk[c.name])
    return chunk


def parquet_file(source, footer: pq.FileMetaData | None, mapped: bool = False) -> pq.ParquetFile:
    """``pq.ParquetFile(source)`` (its footer given where known; memory-mapped with
    ``mapped``) whose reads allocate from ``read_pool()`` (see the module)."""
    parquet = pq.ParquetFile(source, metadata=footer, memory_map=mapped)
    pool, defaults = read_pool(), _open_defaults()
    if pool is not None and defaults is not None:  # opened again as ParquetFile opens it
        reader = ParquetReader(memory_pool=pool)
        reader.open(source, use_memory_map=mapped, metadata=parquet.metadata, **defaults)
        parquet.reader = reader
    return parquet


@functools.cache
def read_pool() -> pa.MemoryPool | None:
    """Arrow's jemalloc pool, where pyarrow was built with it and it is not the default
    pool already (then None: the default)."""
    try:
        pool = pa.jemalloc_memory_pool()
    except NotImplementedError:
        return None
    return None if pool.backend_name == pa.default_memory_pool().backend_name else pool


@functools.cache
def _open_defaults() -> dict[str, Any] | None:
    """What ``pq.ParquetFile`` gives ``ParquetReader.open`` besides the source, the map and
    the footer: its own defaults (None where pyarrow's signatures cannot be read)."""
    try:
        given = inspect.signature(pq.ParquetFile.__init__).parameters
        taken = inspect.signature(ParquetReader.open).parameters
    except (TypeError, ValueError):
        return None
    return {
        name: p.default
        for name, p in given.items()
        if name in taken
        and name not in ("source", "metadata")
        and p.default is not inspect.Parameter.empty
    }


class ArrowReader:
    """Reads pieces of one dataset folder; one instance per rank and split."""

    keeps_order = True  # chunks() follows any piece order, so passes can permute pieces

    def __init__(
        self,
        store: Store,
        root: str,
        columns: list[ColumnSpec],
        num_workers: int,
        split_offsets: dict[tuple[str, int], int] | None = None,
        in_place: InPlace | None = None,
        split: str = "train",
    ):
        self.store, self.root, self.columns = store, root, columns
        self.num_workers = num_workers
        # with the split's row offset of each (file, row group): every chunk gets each
        # row's index in the split as ROW_ID (what per-row augmentation is seeded by)
        self.row_offsets = split_offsets
        # a table read in place: its row groups hold both splits, kept by RowSplit as read
        self.in_place, self.split = in_place, split
        if in_place is not None:
            self._table_offsets = row_offsets(in_place.layout)  # table indices, not a split's
            self._table_rows = dict(in_place.layout)  # each file's rows per row group
            self._split = RowSplit(in_place.fraction, in_place.seed, in_place.column)
            self._sizes = dict(in_place.sizes)
            self._group_bytes = in_place.row_group_bytes()
            self._verified: set[tuple[str, int]] = set()  # (file, first row) checked
        self._footers: dict[str, pq.FileMetaData] = {}
        self._lock = threading.Lock()

    @contextmanager
    def _open(self, path: str) -> Iterator[pq.ParquetFile]:
        full = posixpath.join(self.root, path)
        footer = self._footers.get(path)
        if footer is None and self.in_place is not None:
            self._check_unchanged(path, full)
        with ExitStack() as stack:
            # local files go to pyarrow's native reader (the Store's own files memory-mapped:
            # they never change once written; a table read in place might, and a mapped
            # file cut short under a reader kills it); other filesystems through fsspec
            if self.store.protocol == "file":
                parquet = parquet_file(full, footer, mapped=self.in_place is None)
            else:
                handle = stack.enter_context(self.store.fs.open(full, "rb"))
                parquet = parquet_file(handle, footer)
            stack.callback(parquet.close)
            if footer is None:
                with self._lock:
                    self._footers[path] = parquet.metadata
            yield parquet

    def _check_unchanged(self, path: str, full: str) -> None:
        """A table read in place is read as it was listed: a file of another size changed
        under the fit (its rows and splits would no longer be the ones counted)."""
        size = self.store.fs.size(full)
        if size != self._sizes[path]:
            raise RuntimeError(
                f"the table changed while it was read in place: {full} was {self._sizes[path]}"
                f" bytes when the fit listed it, now {size}; fit again, or set "
                "data_copy='always' to train on a copy of the table"
            )

    def read(self, piece: Piece, stream: _GroupStream | None = None, turn: int = 0) -> Chunk:
        """``piece``'s rows as a chunk; with ``stream``, taken from it as its ``turn``-th
        part (``chunks``)."""
        names = [c.name for c in self.columns]
        if stream is None and self._streamed(piece) and piece.start == 0:
            stream = _GroupStream(self, piece)  # the first rows of a large row group (a
            table = stream.take(0, piece)  # probe, a template): decoded only up to them
        elif stream is not None:
            table = stream.take(turn, piece)
        elif self.in_place is not None:
            table = self._split_rows(piece)
        else:
            with self._open(piece.path) as parquet:
                table = parquet.read_row_group(piece.row_group, columns=names, use_threads=False)
        if piece.rows != table.num_rows:
            table = table.slice(piece.start, piece.rows)
        chunk = table_to_chunk(table, self.columns)
        if self.row_offsets is not None:
            first = self.row_offsets[piece.path, piece.row_group] + piece.start
            chunk[ROW_ID] = np.arange(first, first + piece.rows, dtype=np.int64)
        return chunk

    def _read_names(self) -> list[str]:
        """The columns read of a table read in place: the loader's and the split's."""
        names, column = [c.name for c in self.columns], self._split.column
        return names + ([column] if column and column not in names else [])

    def _split_rows(self, piece: Piece):
        """The row groups of a piece of a table read in place, as their rows of this
        reader's split (which ``piece``'s start and stop count)."""
        with self._open(piece.path) as parquet:
            groups = range(piece.row_group, piece.row_group + piece.groups)
            table = parquet.read_row_groups(groups, columns=self._read_names(), use_threads=False)
        return self.keep_split(table, self._table_offsets[piece.path, piece.row_group], piece.path)

    def keep_split(self, table: pa.Table, first: int, path: str) -> pa.Table:
        """The rows of this reader's split of ``table``, rows of file ``path`` of a table read
        in place from its index ``first`` on, with the loader's columns; their values
        checked the first time they are read where the fit left that to the ranks."""
        if self.in_place.verify and (path, first) not in self._verified:
            self._check_values(table, path)
            self._verified.add((path, first))
        column = self._split.column
        marks = None
        if column is not None:
            marks = pc.fill_null(pc.cast(table.column(column), pa.bool_()), False).to_numpy(
                zero_copy_only=False
            )
        rows = self._split.rows(self.split, first, table.num_rows, marks)
        if len(rows) != table.num_rows:
            table = table.take(pa.array(rows))
        return table.select([c.name for c in self.columns])

    def _check_values(self, table: pa.Table, path: str) -> None:
        """Raise the fit's own check error (``check_observed``) for NaN or infinite values
        in ``table``'s checked columns, or arrays of another length than the one the
        files' statistics gave, naming the file: the checks a fit of a large table leaves
        to the ranks (``InPlace.verify``), made before the first step where a rank holds
        its shard in memory, else as each piece is first read."""
        specs = {c.name: c for c in self.columns}
        columns = [(role, specs[name]) for role, name, _, _ in self.in_place.verify]
        checked = [
            CheckedColumn(name, specs[name].kind in ("array", "vector"), finite)
            for _, name, finite, _ in self.in_place.verify
        ]
        where = f" (found reading {posixpath.join(self.root, path)} in place)"
        try:
            lengths, ragged = check_observed(column_stats(table, checked), columns)
        except ValueError as e:
            raise ValueError(f"{e}{where}") from None
        for role, name, _, length in self.in_place.verify:
            found = lengths.get(name, length)
            if length is not None and (name in ragged or found != length):
                found = "varying lengths" if name in ragged else f"{found} values"
                raise ValueError(
                    f"{column_param(role)}: column '{name}' has arrays of {found} where the "
                    f"files' statistics gave {length} values a row{where}; every row must hold "
                    "as many (or set data_copy='always' to have every row checked before "
                    "training)"
                )

    def _streamed(self, piece: Piece) -> bool:
        """Whether ``piece`` is part of a row group too large to decode once per part
        (``even_pieces`` cuts such row groups): its parts share one ``_GroupStream``."""
        if self.in_place is None or piece.whole or piece.groups != 1:
            return False
        return self._group_bytes.get((piece.path, piece.row_group), 0) > 2 * shards.PIECE_BYTES

    def _streams(self, pieces: list[Piece]) -> list[tuple[_GroupStream | None, int]]:
        """For each of ``pieces``: the stream it is read from and its turn there (None, 0:
        read on its own). Consecutive parts of one row group, each starting where the one
        before stopped, share a stream."""
        out: list[tuple[_GroupStream | None, int]] = []
        for i, piece in enumerate(pieces):
            if not self._streamed(piece):
                out.append((None, 0))
                continue
            before = pieces[i - 1] if i else None
            stream, turn = out[-1] if out else (None, 0)
            if stream is not None and (before.path, before.row_group, before.stop) == (
                piece.path,
                piece.row_group,
                piece.start,
            ):
                stream.parts += 1
                out.append((stream, turn + 1))
            else:
                out.append((_GroupStream(self, piece), 0))
        return out

    def chunks(
        self, pieces: Iterable[Piece], prepare: Callable[[Chunk], Any] | None = None
    ) -> Iterator:
        """``read`` of every piece, in order, prefetching ``num_workers`` pieces ahead;
        with ``prepare``, ``prepare(read(piece))`` (in the same threads)."""
        pieces = list(pieces)
        streams = self._streams(pieces)
        work_items = iter(zip(pieces, streams))

        def work(item):
            piece, (stream, turn) = item
            chunk = self.read(piece) if stream is None else self.read(piece, stream, turn)
            return chunk if prepare is None else prepare(chunk)

        try:
            with ThreadPoolExecutor(
                self.num_workers, thread_name_prefix="spark-estimator-read"
            ) as pool:
                pending = deque(
                    pool.submit(work, p) for _, p in zip(range(self.num_workers), work_items)
                )
                try:
                    while pending:
                        chunk = pending.popleft().result()
                        item = next(work_items, None)
                        if item is not None:
                            pending.append(pool.submit(work, item))
                        yield chunk
                finally:  # the consumer stopped early or failed: drop what is queued
                    for future in pending:
                        future.cancel()
        finally:  # the threads are done: no stream is read any more
            for stream in {id(s): s for s, _ in streams if s is not None}.values():
                stream.close()


class _GroupStream:
    """One row group of a table read in place, decoded once, in order, for its consecutive
    parts (``even_pieces``): each part takes its rows of the split in its turn (the reader's
    threads may start the parts in another order), and the file is closed after the last
    part. A rank whose shard starts inside the row group decodes the rows before it once
    per pass, not once per part."""

    def __init__(self, reader: ArrowReader, first: Piece):
        self.reader, self.first, self.parts = reader, first, 1
        self.turn, self.done = 0, threading.Condition()
        self.stack = ExitStack()
        self.batches: Iterator[pa.RecordBatch] | None = None
        self.at = 0  # the split's row (of the row group) that ``held`` starts at
        self.held: list[pa.Table] = []
        self.table_at = reader._table_offsets[first.path, first.row_group]

    def take(self, turn: int, piece: Piece) -> pa.Table:
        with self.done:
            self.done.wait_for(lambda: self.turn == turn)
        try:
            return self._rows(piece.start, piece.stop)
        finally:
            with self.done:
                self.turn += 1
                if self.turn == self.parts:
                    self.close()
                self.done.notify_all()

    def _rows(self, start: int, stop: int) -> pa.Table:
        if self.batches is None:
            piece, reader = self.first, self.reader
            parquet = self.stack.enter_context(reader._open(piece.path))
            layout = reader._table_rows[piece.path][piece.row_group]
            batch_rows = max(1024, -(-piece.rows * layout // max(1, piece.group_rows)))
            self.batches = parquet.iter_batches(
                batch_rows, row_groups=[piece.row_group], columns=reader._read_names()
            )
        if start < self.at:
            raise RuntimeError(f"row group stream: rows from {start} asked, at {self.at}")
        have = sum(t.num_rows for t in self.held)
        while self.at + have < stop:
            batch = next(self.batches)
            table = pa.Table.from_batches([batch])
            table = self.reader.keep_split(table, self.table_at, self.first.path)
            self.table_at += batch.num_rows
            self.held.append(table)
            have += table.num_rows
        held = pa.concat_tables(self.held) if len(self.held) > 1 else self.held[0]
        part = held.slice(start - self.at, stop - start)
        self.held, self.at = [held.slice(stop - self.at)], stop
        return part

    def close(self) -> None:
        self.batches, self.held = None, []
        self.stack.close()
