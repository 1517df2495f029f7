"""Executor: the optional petastorm reader, with the same pieces as the Arrow reader.

``reader="petastorm"`` reads each rank's row groups through petastorm's
``make_batch_reader``. petastorm yields whole row groups of the files it is given, in path
order, so this reader asks it for the files holding the rank's pieces, walks the row groups
in that order, and keeps only the pieces' rows: the same rows, sharding, exact passes and
step counts as the Arrow reader. The row-group order is the file order; shuffling then
comes from the loader's shuffle buffer alone.

petastorm's own thread pool does not keep that order with several workers and, with one
worker, drops row groups (0.13.1 returned 4 of 7 in our test), so petastorm runs with its
in-thread "dummy" pool inside one background thread of ours, ``num_workers`` row groups
ahead of training.

petastorm 0.13.1 uses pyarrow APIs removed in pyarrow 15, so it imports only on the legacy
stack named in ``shared.packages.PETASTORM_STACK``; anywhere else ``require_petastorm`` says so.
"""

from __future__ import annotations

import posixpath
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ...shared.packages import require_petastorm
from ...shared.spec import ColumnSpec
from ...store import Store
from .arrow_reader import Chunk
from .shards import Piece


class PetastormReader:
    """Reads pieces with petastorm; ``chunks`` needs the pieces in file order."""

    keeps_order = False  # it cannot follow a shuffled piece order

    def __init__(
        self,
        store: Store,
        root: str,
        columns: list[ColumnSpec],
        num_workers: int,
        files: list[tuple[str, list[int]]],
    ):
        self.make_batch_reader = require_petastorm()
        self.store, self.root, self.columns = store, root, columns
        self.num_workers = num_workers
        self.groups = dict(files)  # path -> rows of each row group

    def _url(self, path: str) -> str:
        full = posixpath.join(self.root, path)
        return (
            f"file://{full}" if self.store.protocol == "file" else f"{self.store.protocol}://{full}"
        )

    def chunks(
        self, pieces: list[Piece], prepare: Callable[[Chunk], Any] | None = None
    ) -> Iterator:
        """One chunk per piece (in file order); with ``prepare``, ``prepare(chunk)``, made
        in the reading thread."""
        if not pieces:
            return
        order = [(p.path, p.row_group) for p in pieces]
        if order != sorted(order):
            raise ValueError("reader: petastorm reads row groups in file order only")
        wanted = {(p.path, p.row_group): p for p in pieces}
        paths = sorted({p.path for p in pieces})
        options = None if self.store.protocol == "file" else self.store.storage_options
        expected = [
            (path, index, rows) for path in paths for index, rows in enumerate(self.groups[path])
        ]

        def read_all() -> Iterator[Chunk]:
            with self.make_batch_reader(
                [self._url(p) for p in paths],
                schema_fields=[c.name for c in self.columns],
                reader_pool_type="dummy",
                shuffle_row_groups=False,
                num_epochs=1,
                storage_options=options,
            ) as reader:
                batches = iter(reader)
                for path, index, group_rows in expected:
                    batch = next(batches, None)
                    got = None if batch is None else len(getattr(batch, self.columns[0].name))
                    if got != group_rows:
                        raise RuntimeError(
                            f"reader: petastorm returned {got} rows for row group {index} of "
                            f"{path}, expected {group_rows}"
                        )
                    piece = wanted.get((path, index))
                    if piece is not None:
                        chunk = self._to_chunk(batch._asdict(), piece)
                        yield chunk if prepare is None else prepare(chunk)

        yield from in_background(read_all(), self.num_workers)

    def _to_chunk(self, batch: dict, piece: Piece) -> Chunk:
        return {
            c.name: np.ascontiguousarray(np.asarray(batch[c.name])[piece.start : piece.stop])
            for c in self.columns
        }


def in_background(items: Iterator, depth: int) -> Iterator:
    """Run ``items`` in a thread of its own, at most ``depth`` items ahead of the consumer."""
    results: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce():
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        results.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            results.put((done, None))
        except BaseException as e:  # handed to the consumer, raised there
            results.put((done, e))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=produce, name="spark-estimator-petastorm", daemon=True)
    thread.start()
    try:
        while True:
            item, error = results.get()
            if error is not None:
                raise error
            if item is done:
                return
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                results.get_nowait()
            except queue.Empty:
                thread.join(timeout=0.1)
