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
from .convert import class_indices, column_to_numpy, numpy_dtype
from .shards import Piece

Chunk = dict[str, np.ndarray]  # one piece's columns as read (maybe read-only Arrow memory)


def table_to_chunk(table, columns: list[ColumnSpec]) -> Chunk:
    """Whole Arrow columns to NumPy, one vectorized conversion per column, zero-copy where
    Arrow allows (the arrays may be read-only; the loader copies them once, into its buffer);
    ML vectors are decoded into their column's dtype."""
    chunk = {
        c.name: column_to_numpy(c.name, table.column(c.name), numpy_dtype(c.torch_dtype))
        for c in columns
    }
    for c in columns:
        if c.integral and chunk[c.name].dtype.kind == "f":  # float labels read as classes
            chunk[c.name] = class_indices(c.name, chunk[c.name])
    return chunk


class ArrowReader:
    """Reads pieces of one dataset folder; one instance per rank and split."""

    keeps_order = True  # chunks() follows any piece order, so passes can permute pieces

    def __init__(self, store: Store, root: str, columns: list[ColumnSpec], num_workers: int):
        self.store, self.root, self.columns = store, root, columns
        self.num_workers = num_workers
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
        return table_to_chunk(table, self.columns)

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
