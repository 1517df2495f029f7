"""Executor: the next batches made in a background thread while the current one trains.

When a rank streams its shard, the loader's work per batch (cutting it out of the shuffle
buffer and, on a GPU, copying it from pinned memory to the device) runs in this thread,
``depth`` batches ahead of the training thread. On a GPU the copies go on a side CUDA
stream: the training stream waits for a batch's copy (an event, not the host) and the
batch's memory is marked as used by it, so a copy overlaps the previous step's compute.
A ``transformation_fn`` is not run here but in the training thread, so that the random
numbers it and the model draw from torch's generator come in the same order every run.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

_END = object()
CLOSE_S = 10.0


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetched:
    """``make(item)`` for every item of ``source``, made in a thread ``depth`` items ahead.
    ``tensors(made)`` lists the device tensors of a made item (used on CUDA only)."""

    def __init__(
        self,
        source: Iterable,
        make: Callable[[Any], Any],
        device: torch.device,
        tensors: Callable[[Any], list[torch.Tensor]] = lambda made: [],
        depth: int = 2,
    ):
        self.source, self.make, self.device, self.tensors = source, make, device, tensors
        self.queue: queue.Queue = queue.Queue(depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="spark-estimator-batches")
        self.thread.daemon = True
        self.thread.start()

    def _run(self) -> None:
        try:
            cuda = self.device.type == "cuda"
            side = torch.cuda.Stream(self.device) if cuda else None
            with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
                for item in self.source:
                    made = self.make(item)
                    event = None
                    if cuda:
                        event = torch.cuda.Event()
                        event.record(side)
                    if not self._put((made, event)):
                        return
            self._put(_END)
        except BaseException as error:  # handed to the training thread, raised there
            self._put(_Failed(error))

    def _put(self, value) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(value, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        value = self.queue.get()
        if value is _END:
            raise StopIteration
        if isinstance(value, _Failed):
            raise value.error
        made, event = value
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for tensor in self.tensors(made):
                tensor.record_stream(current)
        return made

    def close(self) -> None:
        """Stop the thread (after the last item, or when training stops early), waiting
        ``CLOSE_S`` at most: a thread still waiting on its source (a decode worker that
        does not answer, whose pool the rank closes next) is left to end by itself."""
        self.stop.set()
        self.thread.join(timeout=CLOSE_S)
