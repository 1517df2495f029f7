"""Executor: how a rank takes a decoded batch out of its worker's shared memory slot.

- ``"view"`` (a rank on the CPU): its tensors are views of the slot, no copy; the slot goes
  back to its worker when no tensor views it any more (after the step that used them, or
  later if the user's code keeps one), through ``release``;
- ``"copy"`` / ``"pin"``: copied out (into pinned memory with ``"pin"``: transform on a GPU,
  which then copies them on), the slot given back at once;
- ``"device"`` (a rank on a GPU): copied to the GPU straight from the slot, on a stream of
  its own, the slot registered with CUDA once (``cudaHostRegister``) so that the copy is an
  asynchronous DMA with no host copy at all; the slot is given back when its copy's event
  has completed (``Delivery.poll``), and the batch's consumer waits for that event on its
  own stream (``ready``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np
import torch

from ..data.columns import host_empty, place
from .batch_format import Placed, SlotBatch
from .decoded import BatchResult
from .shared_memory import Segment

MODES = ("view", "copy", "pin", "device")


class Delivery:
    """Takes batches out of slots the way ``mode`` says (see the module); ``device`` is the
    rank's GPU for ``"device"``."""

    def __init__(self, mode: str, device: torch.device | None = None):
        if mode not in MODES:
            raise ValueError(f"delivery: one of {MODES}, got {mode!r}")
        self.mode, self.device = mode, device
        self.stream = None
        self.registered: dict[int, tuple[Segment, int]] = {}  # id(segment) -> (it, address)
        self.copying: list[tuple[object, Callable[[], None]]] = []  # (event, release)
        if mode == "device":
            self.stream = torch.cuda.Stream(device)

    def take(
        self, batch: SlotBatch, segment: Segment | None, release: Callable[[], None], view: bool
    ) -> BatchResult:
        """``batch``'s tensors out of ``segment`` (see the module); ``release`` gives the slot
        back (called here, or once no view of it is left, or once the device copy is
        done); ``view``: whether this batch may be viewed where the mode views (else it is
        copied: the worker must keep slots to decode into)."""
        if not batch.placed or segment is None:
            release()
            return batch.result(_unplaced)
        if self.mode == "view" and view:
            return _views(batch, segment, release)
        if self.mode == "device":
            return self._to_device(batch, segment, release)
        pin = self.mode == "pin"
        result = batch.result(lambda p: _copied(p, segment, pin))
        release()
        return result

    def _to_device(self, batch: SlotBatch, segment: Segment, release) -> BatchResult:
        address = self._register(segment)
        with torch.cuda.stream(self.stream):
            result = batch.result(lambda p: self._device_copy(p, segment, address))
            event = torch.cuda.Event()
            event.record(self.stream)
        result.ready = event
        self.copying.append((event, release))
        return result

    def _device_copy(self, placed: Placed, segment: Segment, address: int) -> torch.Tensor:
        host = segment.view(placed.offset, placed.torch_dtype, (placed.numel,))
        host = host.as_strided(placed.shape, placed.stride)
        out = torch.empty_strided(
            placed.shape, placed.stride, dtype=placed.torch_dtype, device=self.device
        )
        return out.copy_(host, non_blocking=True)

    def _register(self, segment: Segment) -> int:
        """``segment`` page-locked for the GPU's copies (once), its address."""
        known = self.registered.get(id(segment))
        if known is not None and known[0] is segment:
            return known[1]
        address = segment.address()
        code = torch.cuda.cudart().cudaHostRegister(address, segment.size, 0)
        if int(code) != 0:
            raise RuntimeError(f"cudaHostRegister of a decode slot failed ({code})")
        self.registered[id(segment)] = (segment, address)
        return address

    def forget(self, segment: Segment) -> None:
        """``segment`` (replaced, or its pool closing) is no longer copied from: unregister
        it, its copies done."""
        known = self.registered.pop(id(segment), None)
        if known is not None and known[0] is segment:
            self.stream.synchronize()  # its copies read it
            torch.cuda.cudart().cudaHostUnregister(known[1])

    def poll(self) -> None:
        """Give back the slots whose device copies are done."""
        waiting = []
        for event, release in self.copying:
            if event.query():
                release()
            else:
                waiting.append((event, release))
        self.copying = waiting

    def busy(self) -> bool:
        """Whether device copies are still to complete (``poll`` then)."""
        return bool(self.copying)

    def close(self) -> None:
        """Wait for the device copies, give their slots back, unregister every slot."""
        if self.stream is not None:
            self.stream.synchronize()
        self.poll()
        for segment, _ in list(self.registered.values()):
            self.forget(segment)


def ready(result: BatchResult) -> None:
    """Make the current CUDA stream wait for ``result``'s device copies (a batch delivered
    to the GPU), its tensors marked as used there."""
    event = result.ready
    if event is None or result.decoded is None:
        return
    stream = torch.cuda.current_stream()
    stream.wait_event(event)
    for tensor in result.decoded.tensors().values():
        if tensor.is_cuda:
            tensor.record_stream(stream)
    result.ready = None


def _views(batch: SlotBatch, segment: Segment, release: Callable[[], None]) -> BatchResult:
    """The batch's tensors as views of ``segment``: all of one array of its bytes, whose end
    (no tensor left that views it) gives the slot back."""
    base = np.frombuffer(segment.map, dtype=np.uint8, count=batch.span)
    weakref.finalize(base, release)

    def view(placed: Placed) -> torch.Tensor:
        if not placed.numel:
            return torch.empty(placed.shape, dtype=placed.torch_dtype)
        dtype, count, offset = placed.torch_dtype, placed.numel, placed.offset
        flat = torch.frombuffer(base, dtype=dtype, count=count, offset=offset)
        return flat.as_strided(placed.shape, placed.stride)

    return batch.result(view)


def _copied(placed: Placed, segment: Segment, pin: bool) -> torch.Tensor:
    """The placed tensor copied out of ``segment`` as its worker laid it out (one memcpy,
    NumPy's: without the GIL), then given its shape and strides; pinned with ``pin``."""
    dtype, numel = placed.torch_dtype, placed.numel
    flat = host_empty((numel,), dtype, pin and numel > 0)
    place(flat, segment.view(placed.offset, dtype, (numel,)))
    return flat.as_strided(placed.shape, placed.stride)


def _unplaced(placed: Placed) -> torch.Tensor:
    raise AssertionError(f"a batch without a slot placed {placed.name}")
