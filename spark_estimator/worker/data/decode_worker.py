"""Executor: a decode worker process, which decodes whole batches for its rank.

A rank's ``DecodePool`` starts each as ``python -m spark_estimator.worker.data.decode_worker
FD LABEL``, FD being its end of a Unix socket pair (``Channel``), LABEL whose worker it is
(``rank-3``: what ``ps`` shows). The first message is the
``Recipe`` (the user's functions and the columns, pickled); the worker builds its
``BatchDecoding``, runs ``decode_init_fn`` and answers ``ready`` (or ``failed`` with why).
Then each message is one batch: its raw values, row indices and names, the epoch, and which
of the worker's two slots to decode into. The worker decodes and collates it as the rank's
threads would (the same ``BatchDecoding``), copies the batch's tensors into that slot's
shared memory (``Segment``; a larger one, sent along as a descriptor, when the batch does
not fit) and answers with where each tensor lies, the values that are not tensors (lists
of strings), the rows kept and skipped, the padding counts and its peak memory. An
exception is answered as it is (pickled where it can be), with its traceback.

The worker never outlives its rank: a thread reads the rank's messages as they come (so the
rank's sends never wait on a busy worker) and ends the process when the rank's end of the
socket closes, and another ends it when the process is orphaned. Its prints and logging go
to its stdout and stderr, pipes the rank forwards line by line to its own (so they reach
the rank's log); a crash in native code prints where (``faulthandler``). It has one torch
thread and no GPU (``CUDA_VISIBLE_DEVICES`` is empty).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import pickle
import queue
import resource
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable

import torch

from . import decode_batch
from .decode_batch import BatchDecoding, BatchResult
from .decode_channel import Channel, Segment, ShmFull

SLOTS = 2  # shared memory slots per worker: one decoded into while the rank reads the other
_ALIGN = 64


def main(fd: int) -> None:
    decode_batch.IN_WORKER_PROCESS = True
    faulthandler.enable(all_threads=False)  # the decoding thread: where it crashed
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    torch.set_num_threads(1)
    _watch_parent(os.getppid())
    channel = Channel(socket.socket(fileno=fd))
    (_, recipe), _ = channel.recv()
    try:
        decoding = BatchDecoding(pickle.loads(recipe))
        decoding.init()
    except BaseException as e:
        channel.send(("failed", describe(e)))
        return
    channel.send(("ready", os.getpid()))
    requests: queue.Queue = queue.Queue()
    threading.Thread(target=_receive, args=(channel, requests), daemon=True).start()
    writer = SlotWriter()
    while True:
        message = requests.get()
        if message[0] == "close":
            break
        _, seq, slot, epoch, values, ids, names = message
        result = None  # the last batch's tensors, which may view a retired segment, gone
        try:
            decoding.allocate = writer.begin(slot)
            result = decoding.decode(values, ids, names, epoch)
            reply, fds = writer.write(slot, result)
        except BaseException as e:
            channel.send(("error", seq, describe(e)))
            continue
        channel.send(("done", seq, reply, peak_rss()), fds)


def _receive(channel: Channel, requests: queue.Queue) -> None:
    """Hand the rank's messages to the decoding loop as they come; the rank gone, end."""
    try:
        while True:
            message, _ = channel.recv()
            requests.put(message)
    except (EOFError, OSError):
        os._exit(0)


def _watch_parent(parent: int) -> None:
    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)  # orphaned: the rank died without closing the socket first

    threading.Thread(target=watch, daemon=True).start()


def peak_rss() -> int:
    """This process's peak resident memory in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def describe(error: BaseException) -> tuple[bytes | None, str, str, str]:
    """An exception for the rank: pickled where it can be, its type, message and
    traceback."""
    text = "".join(traceback.format_exception(error))
    try:
        data = pickle.dumps(error)
        pickle.loads(data)
    except Exception:
        data = None
    return data, type(error).__name__, str(error), text


class SlotWriter:
    """The worker's slots of shared memory and what it writes into them. A batch's stacked
    columns are collated straight into its slot (``begin`` gives ``BatchDecoding`` where);
    ``write`` copies in the rest and says where each tensor lies."""

    def __init__(self):
        self.slots: list[Segment | None] = [None] * SLOTS
        self.retired: list[Segment] = []  # replaced while a batch's tensors still viewed them
        self.placed: dict[int, tuple[int, int]] = {}  # data pointer -> (offset, bytes) in the slot
        self.used = 0
        self.inline_warned = False

    def begin(self, slot: int) -> Callable[[tuple[int, ...], torch.dtype], torch.Tensor | None]:
        """Start a batch in ``slot`` (the last batch's tensors gone); where its collation
        may stack a column: memory of ``slot`` after what is placed, None where it does not
        fit (the column is then copied in by ``write``)."""
        self.retired = [s for s in self.retired if not _closed(s)]
        self.placed, self.used = {}, 0
        segment = self.slots[slot]

        def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
            size = _aligned(int(torch.Size(shape).numel()) * dtype.itemsize)
            if segment is None or not size or self.used + size > segment.size:
                return None
            tensor = segment.view(self.used, dtype, shape)
            self.placed[tensor.data_ptr()] = (self.used, size)
            self.used += size
            return tensor

        return allocate

    def write(self, slot: int, result: BatchResult) -> tuple[dict, tuple[int, ...]]:
        """``result``'s tensors in ``slot`` (grown where they do not fit; those collated
        into it already left where they are); the reply saying where they lie, and the
        descriptor of a new segment if one was made."""
        reply = {
            "rows": result.decoded.rows if result.decoded is not None else 0,
            "kept": result.kept,
            "skipped": result.skipped,
            "padding": result.padding,
            "layout": [],
            "inline": {},
            "segment": None,
            "order": [],  # the batch's columns in their order
        }
        if result.decoded is None:
            return reply, ()
        reply["order"] = list(result.decoded.columns)
        tensors, copied, layout, size = [], [], [], self.used  # copied: those not in place
        for where, values in (("columns", result.decoded.columns), ("masks", result.decoded.masks)):
            for name, value in values.items():
                if not isinstance(value, torch.Tensor):
                    reply["inline"][(where, name)] = value
                    continue
                value = value.detach().cpu()
                stride = value.stride() if _dense(value) else _contiguous_stride(value.shape)
                offset, room = self.placed.pop(value.data_ptr(), (None, 0))
                if offset is None or not _dense(value) or _span(value) > room:
                    offset = size
                    size += _aligned(_span(value))
                    copied.append(len(tensors))
                layout.append((where, name, offset, str(value.dtype), tuple(value.shape), stride))
                tensors.append(value)
        fds: tuple[int, ...] = ()
        segment = self.slots[slot]
        if segment is None or segment.size < size:
            try:
                grown = Segment(max(size, int(segment.size * 1.5) if segment else size, 1))
            except ShmFull as e:
                return self._inline(reply, layout, tensors, e), ()
            if segment is not None:
                self.retired.append(segment)  # closed once this batch's tensors are gone
            self.slots[slot] = segment = grown
            reply["segment"], fds = grown.size, (grown.fd,)
            copied = range(len(tensors))  # all of them, into the new one
        for index in copied:
            tensor, (_, _, offset, _, shape, stride) = tensors[index], layout[index]
            flat = segment.view(offset, tensor.dtype, (tensor.numel(),))
            flat.as_strided(shape, stride).copy_(tensor)
        reply["layout"] = layout
        return reply, fds

    def _inline(self, reply: dict, layout: list, tensors: list, error: ShmFull) -> dict:
        """The batch's tensors in the reply itself, where shared memory is full."""
        if not self.inline_warned:
            self.inline_warned = True
            logging.getLogger("spark_estimator.worker.data.decode").warning(
                "decode worker: no room for a batch in shared memory (%s); its batches go "
                "through the socket instead, which is slower (see SPARK_ESTIMATOR_SHM_DIR)",
                error.strerror,
            )
        for (where, name, *_), tensor in zip(layout, tensors):
            reply["inline"][(where, name)] = tensor.clone()
        return reply


def _closed(segment: Segment) -> bool:
    """Close ``segment`` if no tensor views it any more; whether it was closed."""
    try:
        segment.close()
    except BufferError:  # still viewed: tried again at the next batch
        return False
    return True


def _span(tensor: torch.Tensor) -> int:
    """The bytes from a dense tensor's first element to the end of its last."""
    return tensor.numel() * tensor.element_size()


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


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


if __name__ == "__main__":
    main(int(sys.argv[1]))
