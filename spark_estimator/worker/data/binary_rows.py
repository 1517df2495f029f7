"""Executor: a binary or string column's rows as references into the Arrow memory they were
read into.

A binary column (encoded images, other bytes) is most of a batch's bytes, and one Python
``bytes`` per row cost the loader ~4.4 us a 7 KB row to make (``to_pylist``), more to free,
and its sending to a decode worker a pickle that copied them all once more. ``BinaryRows``
holds instead, per row, which of its ``parts`` (the data buffers of the chunks read)
it is in, where it starts and how long it is: the shuffle, a batch's cut, bucketing and
bad-row removal move three integers a row (NumPy, in place where asked), and the bytes stay
where Parquet decoding put them. With decode worker processes a chunk's large binary rows
are read straight into shared memory (``worker.decode.shared_rows``) and a worker reads a
batch's rows there; other rows go to it copied once into shared memory
(``worker.decode.inbox``), or pickled (joined, one copy in C) where there is none; either
way the worker has them as the NumPy array of ``bytes`` (``str`` for a string column) that
``decode_fn`` has always had. Where the rank decodes itself (threads), the rows become
Python objects as they are read.

A part stays in memory while any row refers to it; ``compacted`` copies the rows into one
part of their own where the parts they hold are much larger than they are (a shuffle
buffer's kept rows of many chunks).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa

_EMPTY = memoryview(b"")
SPARSE = 2  # ``compacted`` copies the rows where their parts hold this many times their bytes


class BinaryRows:
    """Rows of bytes (``text``: UTF-8 strings): row ``i`` is
    ``parts[part[i]][start[i] : start[i] + length[i]]``.

    Indexing with an integer gives ``bytes`` (``str``); with a slice or an index array the
    rows selected, which share ``parts`` (a slice's arrays are views: setting its rows sets
    the rows it was cut from, as NumPy's do); setting rows (``rows[index] = other``) takes
    the other rows' references, adding the parts they need.
    """

    __slots__ = ("parts", "part", "start", "length", "text")

    def __init__(
        self,
        parts: list,  # buffers: memoryviews of Arrow's, arrays of shared segments
        part: np.ndarray,
        start: np.ndarray,
        length: np.ndarray,
        text: bool = False,
    ):
        self.parts, self.part, self.start, self.length = parts, part, start, length
        self.text = text

    @classmethod
    def from_arrow(cls, array: pa.Array) -> BinaryRows:
        """The rows of a binary or string Arrow array without nulls (its memory, not
        copied)."""
        large = pa.types.is_large_binary(array.type) or pa.types.is_large_string(array.type)
        text = pa.types.is_string(array.type) or pa.types.is_large_string(array.type)
        _, offsets, data = array.buffers()
        offsets = np.frombuffer(offsets, dtype=np.int64 if large else np.int32)
        offsets = offsets[array.offset : array.offset + len(array) + 1].astype(np.int64)
        part = np.zeros(len(array), dtype=np.int32)
        held = memoryview(data).cast("B") if data is not None else _EMPTY
        return cls([held], part, offsets[:-1], np.diff(offsets), text)

    @classmethod
    def empty(cls, rows: int = 0, text: bool = False) -> BinaryRows:
        """``rows`` rows to be set (``rows[index] = other``)."""
        positions = np.empty(rows, np.int64), np.empty(rows, np.int64)
        return cls([], np.empty(rows, np.int32), *positions, text)

    @classmethod
    def concatenate(cls, rows: list[BinaryRows]) -> BinaryRows:
        """``rows``, one after the other (their references; no bytes copied)."""
        out = cls.empty(sum(len(r) for r in rows), rows[0].text)
        at = 0
        for r in rows:
            out[at : at + len(r)] = r
            at += len(r)
        return out

    def copy(self) -> BinaryRows:
        """The same rows, set apart from these (setting either leaves the other)."""
        arrays = self.part.copy(), self.start.copy(), self.length.copy()
        return BinaryRows(list(self.parts), *arrays, self.text)

    def __len__(self) -> int:
        return len(self.part)

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            p, s = int(self.part[key]), int(self.start[key])
            value = self.parts[p][s : s + int(self.length[key])]
            return str(value, "utf-8") if self.text else bytes(value)
        return BinaryRows(self.parts, self.part[key], self.start[key], self.length[key], self.text)

    def __setitem__(self, key, rows: BinaryRows) -> None:
        if not isinstance(rows, BinaryRows):
            raise TypeError(f"BinaryRows: rows are set from BinaryRows, not {type(rows).__name__}")
        part = rows.part
        if rows.parts is not self.parts and len(part):
            where = {id(p): i for i, p in enumerate(self.parts)}
            remap = np.zeros(len(rows.parts), dtype=np.int32)
            for used in _used(part, len(rows.parts)):
                held = rows.parts[used]
                if id(held) not in where:
                    where[id(held)] = len(self.parts)
                    self.parts.append(held)
                remap[used] = where[id(held)]
            part = remap[part]
        self.part[key], self.start[key], self.length[key] = part, rows.start, rows.length

    def views(self) -> list[memoryview]:
        """Each row's bytes, where they are (no copy)."""
        parts = self.parts
        return [
            parts[p][s : s + n]
            for p, s, n in zip(self.part.tolist(), self.start.tolist(), self.length.tolist())
        ]

    def tolist(self) -> list:
        """The rows as ``bytes`` (``str``)."""
        return _values(self.views(), self.text)

    def __iter__(self) -> Iterator:
        return iter(self.tolist())

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return objects(self.views(), self.text)

    @property
    def nbytes(self) -> int:
        """The rows' bytes."""
        return int(np.add.reduce(self.length))

    def held_bytes(self) -> int:
        """The bytes of the parts the rows refer to (what they keep in memory)."""
        return sum([len(self.parts[p]) for p in _used(self.part, len(self.parts))])

    def compacted(self) -> BinaryRows:
        """These rows, in one new part of their own where the parts they refer to hold more
        than ``SPARSE`` times their bytes (else themselves)."""
        if self.held_bytes() <= SPARSE * self.nbytes:
            return self
        data = memoryview(b"".join(self.views()))
        offsets = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(self.length, out=offsets[1:])
        part = np.zeros(len(self), dtype=np.int32)
        return BinaryRows([data], part, offsets[:-1], self.length.copy(), self.text)

    def __reduce__(self):
        """Pickled as the NumPy array of ``bytes`` (``str``) it stands for: the rows'
        lengths and their bytes joined (in C)."""
        return rows_in, (self.length, b"".join(self.views()), self.text)


def _used(part: np.ndarray, parts: int) -> list[int]:
    """The parts that rows ``part`` refer to (of ``parts``)."""
    if parts == 1:
        return [0] if len(part) else []
    return np.flatnonzero(np.bincount(part, minlength=parts)).tolist()


def rows_in(lengths: np.ndarray, data, text: bool) -> np.ndarray:
    """The rows of ``lengths`` bytes lying one after the other from the start of ``data``
    (a bytes-like), as ``objects`` makes them."""
    data, ends = memoryview(data), np.cumsum(lengths).tolist()
    return objects([data[a:b] for a, b in zip([0, *ends], ends)], text)


def objects(views: list, text: bool) -> np.ndarray:
    """Rows' bytes (``views``) as the NumPy array of ``bytes`` (``text``: ``str``) that
    decoding takes."""
    out = np.empty(len(views), dtype=object)
    out[:] = _values(views, text)
    return out


def _values(views: list, text: bool) -> list:
    return [str(v, "utf-8") for v in views] if text else [bytes(v) for v in views]
