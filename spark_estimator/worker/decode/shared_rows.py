"""Executor: the loader's binary rows read straight into shared memory, so that a rank's
decode workers read a batch's rows where they are.

With worker processes, each chunk's large ``BinaryRows`` (encoded images: ``SHARE_FROM``
bytes or more) are copied, in the reader thread that read them, from Arrow's memory into a
segment of shared memory (``SharedRows.share``: one copy of the chunk's bytes, in one run,
while they are still in that core's cache; Arrow's buffers are then freed at once and
reused for the next piece, rather than faulted in fresh). A new segment is announced to
every worker as it is made (its descriptor sent along; the rank then closes its own), so
the workers map each once (``inbox.Inbox``). A batch cut from such rows is described to its
worker by segment, start and length a row (``SharedRows.describe``: three small arrays, no
bytes copied on the rank). A segment goes back to the free list when no row refers to it
any more (its array's finalizer); the rank holds each batch's rows until its worker
answered for it, so a segment is never written while a worker reads it; a segment closed
(more free than ``FREE_KEPT``) is unmapped by the workers at their next batch. Other rows (a
compacted shuffle buffer's, strings, transform's) go through the slot's input segment
(``inbox.Inboxes``).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from ..data.binary_rows import BinaryRows
from ..data.columns import Columns
from .shared_memory import Segment, ShmFull

SHARE_FROM = 1 << 18  # a chunk's column of fewer bytes is not shared (the inbox copies it)
FREE_KEPT = 16  # free segments kept for reuse; more are closed


class InShared(NamedTuple):
    """A column's rows in the rank's shared segments: per row its segment's key, start and
    length (``text``: UTF-8 strings)."""

    segment: np.ndarray
    start: np.ndarray
    length: np.ndarray
    text: bool


class SharedRows:
    """A rank's segments of shared chunk bytes (see the module). ``announce(key, size,
    fd)`` tells every worker of a new segment."""

    def __init__(self, announce: Callable[[int, int, int], None]):
        self.announce = announce
        self.lock = threading.RLock()  # re-entered where a finalizer runs under it
        self.free: list[tuple[int, Segment]] = []  # (key, segment)
        self.keys = itertools.count()
        self.key_of: dict[int, int] = {}  # id(a part's array) -> its segment's key
        self.gone: list[int] = []  # keys of the segments closed, in order (workers unmap)
        self.closed = False

    def share(self, columns: Columns) -> Columns:
        """``columns`` with each large binary column of one part (as read) copied into a
        shared segment; other columns left as they are."""
        columns.raws = [self._shared(r) if _worth(r) else r for r in columns.raws]
        return columns

    def _shared(self, rows: BinaryRows) -> BinaryRows:
        first = int(rows.start[0])
        size = int(rows.start[-1] + rows.length[-1]) - first
        try:
            key, segment = self._take(size)
        except ShmFull:
            return rows  # left in Arrow's memory: such batches go through the inbox
        part = np.frombuffer(segment.map, dtype=np.uint8, count=size)
        part[:] = np.frombuffer(rows.parts[0], dtype=np.uint8)[first : first + size]
        with self.lock:
            self.key_of[id(part)] = key
        weakref.finalize(part, self._give_back, id(part), key, segment)
        return BinaryRows([part], rows.part.copy(), rows.start - first, rows.length, rows.text)

    def _take(self, size: int) -> tuple[int, Segment]:
        """A free segment of at least ``size`` bytes, or a new one (announced); its key."""
        with self.lock:
            for i, (_, segment) in enumerate(self.free):
                if segment.size >= size:
                    return self.free.pop(i)
            key = next(self.keys)
        segment = Segment(_size_class(size))
        try:
            self.announce(key, segment.size, segment.fd)
        finally:  # the workers have their own descriptors now; the mapping stays
            segment.close_fd()
        return key, segment

    def _give_back(self, part_id: int, key: int, segment: Segment) -> None:
        with self.lock:
            self.key_of.pop(part_id, None)
            if self.closed or len(self.free) >= FREE_KEPT:
                segment.close()
                self.gone.append(key)
            else:
                self.free.append((key, segment))

    def describe(self, values: Mapping[str, Any]) -> dict:
        """``values`` with each ``BinaryRows`` whose parts are all shared segments as
        ``InShared`` (the others as they are)."""
        with self.lock:
            key_of = self.key_of
            described = {}
            for name, rows in values.items():
                if isinstance(rows, BinaryRows):
                    keys = [key_of.get(id(p)) for p in rows.parts]
                    if None not in keys:
                        segment = np.array(keys, dtype=np.int64)[rows.part]
                        rows = InShared(segment, rows.start, rows.length, rows.text)
                described[name] = rows
        return described

    def gone_since(self, seen: int) -> tuple[list[int], int]:
        """The keys of the segments closed after the first ``seen``, and how many are now."""
        with self.lock:
            return self.gone[seen:], len(self.gone)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            for _, segment in self.free:
                segment.close()
            self.free.clear()


def _worth(rows) -> bool:
    """Rows as a reader made them (one part, not shared yet), of ``SHARE_FROM`` bytes or
    more."""
    if not isinstance(rows, BinaryRows) or len(rows.parts) != 1 or not len(rows):
        return False
    return isinstance(rows.parts[0], memoryview) and rows.nbytes >= SHARE_FROM


def _size_class(size: int) -> int:
    """A segment's bytes for ``size``: the next power of two (free segments fit more
    chunks; at most twice what one needs)."""
    return 1 << max(size - 1, SHARE_FROM - 1).bit_length()
