"""Executor: a decoded batch in a decode worker's shared memory slot, as the worker writes
it and its rank reads it.

The worker collates a batch's stacked columns straight into its slot (``SlotWriter.begin``
gives the collation where), copies in the other tensors (``SlotWriter.write``) and answers
with a ``SlotBatch``: where each tensor lies (``Placed``: offset, dtype, shape and strides,
so channels-last images keep their layout), the values that are not tensors (strings), and
what decoding reported. A slot that is too small for a batch is replaced by a larger
segment, sent along as a descriptor (``SlotBatch.segment_size``); where no segment can be
made (memory ran out), the batch's tensors travel in the message itself
(``SlotBatch.inline_reason`` says why). The rank makes its tensors of each ``Placed`` with
``SlotBatch.result``: views of the slot, copies, or copies on its GPU (``delivery``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .collate import Allocate
from .decoded import BatchResult, Decoded
from .shared_memory import Segment, ShmFull

ALIGN = 64  # each tensor's offset in a slot


@dataclass(frozen=True)
class Placed:
    """Where one tensor of a batch lies in its slot: ``where`` is "columns" or "masks"."""

    where: str
    name: str
    offset: int
    dtype: str  # torch's name of it: "uint8", "bfloat16", ...
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


@dataclass
class SlotBatch:
    """A decoded batch as its worker describes it (see the module)."""

    rows: int
    kept: np.ndarray | None
    skipped: list[tuple[bool, int]]
    padding: list[int]
    order: list[str] = field(default_factory=list)  # the batch's columns in their order
    placed: list[Placed] = field(default_factory=list)
    inline: dict[tuple[str, str], Any] = field(default_factory=dict)
    segment_size: int | None = None  # the slot's new segment (its descriptor sent along)
    inline_reason: str | None = None  # why its tensors travel in the message

    @property
    def span(self) -> int:
        """The bytes of its slot it uses."""
        return max((p.offset + p.nbytes for p in self.placed), default=0)

    def result(self, tensor_of: Callable[[Placed], torch.Tensor]) -> BatchResult:
        """The batch, each placed tensor made by ``tensor_of``."""
        parts: dict[str, dict] = {"columns": {}, "masks": {}}
        for (where, name), value in self.inline.items():
            parts[where][name] = value
        for placed in self.placed:
            parts[placed.where][placed.name] = tensor_of(placed)
        decoded = None
        if self.rows or parts["columns"]:
            columns = {n: parts["columns"][n] for n in self.order}
            decoded = Decoded(columns, parts["masks"], self.rows)
        return BatchResult(decoded, self.kept, self.skipped, self.padding)


class SlotWriter:
    """A worker's slots of shared memory and what it writes into them (see the module)."""

    def __init__(self):
        self.slots: dict[int, Segment] = {}
        self.placed: dict[int, tuple[int, int]] = {}  # data pointer -> (offset, bytes) in the slot
        self.used = 0

    def begin(self, slot: int) -> Allocate:
        """Start a batch in ``slot``; where its collation may stack a column: memory of
        ``slot`` after what is placed, None where it does not fit (the column is then
        copied in by ``write``)."""
        self.placed, self.used = {}, 0
        segment = self.slots.get(slot)

        def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
            size = aligned(int(torch.Size(shape).numel()) * dtype.itemsize)
            if segment is None or not size or self.used + size > segment.size:
                return None
            tensor = segment.view(self.used, dtype, shape)
            self.placed[tensor.data_ptr()] = (self.used, size)
            self.used += size
            return tensor

        return allocate

    def write(self, slot: int, result: BatchResult) -> tuple[SlotBatch, tuple[int, ...]]:
        """``result``'s tensors in ``slot`` (grown where they do not fit; those collated into
        it already left where they are): the ``SlotBatch`` saying where they lie, and the
        descriptor of the slot's new segment if one was made."""
        decoded = result.decoded
        rows = decoded.rows if decoded is not None else 0
        batch = SlotBatch(rows, result.kept, result.skipped, result.padding)
        if decoded is None:
            return batch, ()
        batch.order = list(decoded.columns)
        tensors, copied, size = [], [], self.used  # copied: the tensors not in place
        for where, values in (("columns", decoded.columns), ("masks", decoded.masks)):
            for name, value in values.items():
                if not isinstance(value, torch.Tensor):
                    batch.inline[(where, name)] = value
                    continue
                value = value.detach().cpu()
                stride = value.stride() if _dense(value) else _contiguous_stride(value.shape)
                offset, room = self.placed.pop(value.data_ptr(), (None, 0))
                if offset is None or not _dense(value) or _nbytes(value) > room:
                    offset = size
                    size += aligned(_nbytes(value))
                    copied.append(len(tensors))
                dtype = str(value.dtype).removeprefix("torch.")
                batch.placed.append(Placed(where, name, offset, dtype, tuple(value.shape), stride))
                tensors.append(value)
        fds: tuple[int, ...] = ()
        if not tensors:
            return batch, fds
        segment = self.slots.get(slot)
        if segment is None or segment.size < size:
            try:
                grown = Segment(max(size, int(segment.size * 1.5) if segment else size, 1))
            except ShmFull as e:
                return _inline(batch, tensors, e), ()
            if segment is not None:
                segment.close()  # its memory goes with this batch's last view of it
            self.slots[slot] = segment = grown
            batch.segment_size, fds = grown.size, (grown.fd,)
            copied = range(len(tensors))  # all of them, into the new one
        for index in copied:
            tensor, placed = tensors[index], batch.placed[index]
            flat = segment.view(placed.offset, tensor.dtype, (tensor.numel(),))
            flat.as_strided(placed.shape, placed.stride).copy_(tensor)
        return batch, fds


def _inline(batch: SlotBatch, tensors: list[torch.Tensor], error: ShmFull) -> SlotBatch:
    """The batch's tensors in the message itself, where no shared memory could be had."""
    for placed, tensor in zip(batch.placed, tensors):
        batch.inline[(placed.where, placed.name)] = tensor.clone()
    batch.placed = []
    batch.inline_reason = error.strerror
    return batch


def _nbytes(tensor: torch.Tensor) -> int:
    """The bytes from a dense tensor's first element to the end of its last."""
    return tensor.numel() * tensor.element_size()


def aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def _dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill its memory in some order (contiguous, or
    channels-last), so that it can be copied with its strides as they are."""
    if tensor.is_contiguous():
        return True
    return tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last)


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, out = 1, []
    for n in reversed(shape):
        out.append(stride)
        stride *= max(n, 1)
    return tuple(reversed(out))
