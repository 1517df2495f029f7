"""Executor: a batch's rows of bytes handed to its decode worker through shared memory.

The loader keeps binary and string columns as ``BinaryRows`` (references into the memory
they were read into). Rows already in the rank's shared chunk segments (``shared_rows``)
are described where they are (``InShared``), and the worker reads them out of its mapping
of those segments (``Inbox.map_shared``, ``Inbox.take``). Other rows (strings, a compacted
shuffle buffer's, transform's) would be copied three times on the rank through the
worker's socket (joined, into the kernel, out of it); posted instead, they are copied once,
row by row, into an input segment of the slot the batch decodes into (``Inboxes.post``: a
segment per worker and slot, made or grown as batches need, its descriptor sent with the
first batch that uses it), and the message carries where each column's rows lie
(``Posted``). The worker has them as the NumPy arrays of ``bytes`` (``str``) the decoding
has always had. A slot's input is only written again when the slot is taken again, after
its worker answered for the batch before. Where no segment can be made (memory ran out),
the rows travel in the message (``BinaryRows``' pickling) as they would without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from ..data.binary_rows import BinaryRows, objects, rows_in
from .shared_memory import Segment, ShmFull
from .shared_rows import InShared

SMALLEST = 1 << 20  # an input segment's bytes, at least
GROWTH = 1.25  # a new segment's size over what the batch that needs it takes


class Posted(NamedTuple):
    """Where a column's rows lie in the input segment: from ``offset``, one after the other,
    of ``lengths`` bytes (``text``: UTF-8 strings)."""

    offset: int
    lengths: np.ndarray
    text: bool


class Inboxes:
    """The rank's input segments, one per (worker, slot)."""

    def __init__(self):
        self.segments: dict[tuple[int, int], Segment] = {}

    def post(
        self, key: tuple[int, int], values: Mapping[str, Any], names: Any
    ) -> tuple[dict, Any, int | None, tuple[int, ...]]:
        """``values`` (column -> rows) and ``names`` with their ``BinaryRows`` written into
        the input segment of ``key`` (worker, slot), as ``Posted``; the segment's size and
        descriptor where it is new (the worker maps it), else None and no descriptor."""
        rows = [v for v in (*values.values(), names) if isinstance(v, BinaryRows)]
        if not rows:
            return dict(values), names, None, ()
        need = sum([r.nbytes for r in rows])
        segment, new = self.segments.get(key), None
        if segment is None or segment.size < need:
            try:
                fresh = Segment(max(SMALLEST, int(need * GROWTH)))
            except ShmFull:
                return dict(values), names, None, ()  # the rows go in the message
            if segment is not None:
                segment.close()
            self.segments[key] = segment = fresh
            new = segment.size
        memory, at = memoryview(segment.map), 0

        def posted(value):
            nonlocal at
            if not isinstance(value, BinaryRows):
                return value
            start = at
            for view in value.views():
                end = at + view.nbytes
                memory[at:end] = view
                at = end
            return Posted(start, value.length, value.text)

        values = {name: posted(value) for name, value in values.items()}
        names = posted(names)
        memory.release()
        return values, names, new, (segment.fd,) if new is not None else ()

    def close(self) -> None:
        for segment in self.segments.values():
            segment.close()
        self.segments.clear()


class Inbox:
    """A worker's mappings of its input segments, by slot, and of its rank's shared chunk
    segments (``shared_rows``), by key."""

    def __init__(self):
        self.segments: dict[int, Segment] = {}
        self.shared: dict[int, Segment] = {}

    def map_shared(self, key: int, size: int, fd: int) -> None:
        """Map the rank's shared chunk segment ``key`` (its descriptor closed once mapped)."""
        segment = Segment(size, fd)
        segment.close_fd()
        self.shared[key] = segment

    def unmap_shared(self, keys: list[int]) -> None:
        """Unmap the rank's shared chunk segments ``keys`` (which it closed)."""
        for key in keys:
            segment = self.shared.pop(key, None)
            if segment is not None:
                segment.close()

    def take(self, slot: int, size: int | None, fds: list[int], values: dict, names):
        """The batch's ``values`` and ``names`` with each ``Posted`` read out of the slot's
        input segment (first mapping the new one, of ``size`` bytes, sent as ``fds[0]``)."""
        if size is not None:
            old = self.segments.pop(slot, None)
            if old is not None:
                old.close()
            self.segments[slot] = Segment(size, fds[0])
        segment = self.segments.get(slot)

        def taken(value):
            if isinstance(value, InShared):
                return self._shared_rows(value)
            if not isinstance(value, Posted):
                return value
            return rows_in(value.lengths, memoryview(segment.map)[value.offset :], value.text)

        return {name: taken(value) for name, value in values.items()}, taken(names)

    def _shared_rows(self, value: InShared) -> np.ndarray:
        """Rows described in the rank's chunk segments, as bytes (str)."""
        memory = {key: memoryview(self.shared[key].map) for key in set(value.segment.tolist())}
        rows = zip(value.segment.tolist(), value.start.tolist(), value.length.tolist())
        return objects([memory[k][s : s + n] for k, s, n in rows], value.text)

    def close(self) -> None:
        for segment in (*self.segments.values(), *self.shared.values()):
            segment.close()
        self.segments.clear()
        self.shared.clear()
