"""Executor: read pieces of Parquet row groups with pyarrow, in background threads.

``ArrowReader.chunks(pieces)`` yields one dict of NumPy arrays per piece, in the order given,
while up to ``num_workers`` further pieces are read and converted in a thread pool, so
reading overlaps the training step (pyarrow releases the GIL while it decodes); a
``prepare`` function given to ``chunks`` (the loader's layout) runs on each chunk in those
threads too. Footers are parsed once per file and shared by the threads.
"""

from __future__ import annotations

import posixpath
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from ...shared.spec import ColumnSpec
from ...store import Store
from .convert import class_indices, column_to_numpy, numpy_dtype, variable_to_numpy
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
    ML vectors are decoded into their column's dtype; a variable column's rows become an
    array of Python objects (``variable_to_numpy``)."""
    chunk = {
        c.name: variable_to_numpy(c, table.column(c.name))
        if c.variable
        else column_to_numpy(c.name, table.column(c.name), numpy_dtype(c.torch_dtype))
        for c in columns
    }
    for c in columns:
        if c.integral and chunk[c.name].dtype.kind == "f":  # float labels read as classes
            chunk[c.name] = class_indices(c.name, chunk[c.name])
    return chunk


class ArrowReader:
    """Reads pieces of one dataset folder; one instance per rank and split."""

    keeps_order = True  # chunks() follows any piece order, so passes can permute pieces

    def __init__(
        self,
        store: Store,
        root: str,
        columns: list[ColumnSpec],
        num_workers: int,
        row_offsets: dict[tuple[str, int], int] | None = None,
    ):
        self.store, self.root, self.columns = store, root, columns
        self.num_workers = num_workers
        # with the split's row offset of each (file, row group): every chunk gets each
        # row's index in the split as ROW_ID (what per-row augmentation is seeded by)
        self.row_offsets = row_offsets
        self._footers: dict[str, pq.FileMetaData] = {}
        self._lock = threading.Lock()

    @contextmanager
    def _open(self, path: str) -> Iterator[pq.ParquetFile]:
        full = posixpath.join(self.root, path)
        footer = self._footers.get(path)
        with ExitStack() as stack:
            # local files go to pyarrow's native reader; other filesystems through fsspec
            if self.store.protocol == "file":
                parquet = pq.ParquetFile(full, metadata=footer)
            else:
                handle = stack.enter_context(self.store.fs.open(full, "rb"))
                parquet = pq.ParquetFile(handle, metadata=footer)
            stack.callback(parquet.close)
            if footer is None:
                with self._lock:
                    self._footers[path] = parquet.metadata
            yield parquet

    def read(self, piece: Piece) -> Chunk:
        with self._open(piece.path) as parquet:
            table = parquet.read_row_group(piece.row_group, columns=[c.name for c in self.columns])
        if piece.rows != table.num_rows:
            table = table.slice(piece.start, piece.rows)
        chunk = table_to_chunk(table, self.columns)
        if self.row_offsets is not None:
            first = self.row_offsets[piece.path, piece.row_group] + piece.start
            chunk[ROW_ID] = np.arange(first, first + piece.rows, dtype=np.int64)
        return chunk

    def chunks(
        self, pieces: Iterable[Piece], prepare: Callable[[Chunk], Any] | None = None
    ) -> Iterator:
        """``read`` of every piece, in order, prefetching ``num_workers`` pieces ahead;
        with ``prepare``, ``prepare(read(piece))`` (in the same threads)."""
        pieces = iter(pieces)

        def work(piece: Piece):
            chunk = self.read(piece)
            return chunk if prepare is None else prepare(chunk)

        with ThreadPoolExecutor(
            self.num_workers, thread_name_prefix="spark-estimator-read"
        ) as pool:
            pending = deque(pool.submit(work, p) for _, p in zip(range(self.num_workers), pieces))
            try:
                while pending:
                    chunk = pending.popleft().result()
                    piece = next(pieces, None)
                    if piece is not None:
                        pending.append(pool.submit(work, piece))
                    yield chunk
            finally:  # the consumer stopped early or failed: drop what is queued
                for future in pending:
                    future.cancel()
