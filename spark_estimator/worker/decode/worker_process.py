"""Executor: a decode worker process, which decodes whole batches for its rank.

Its rank's fork server (``fork_server``) forks it from itself, with its end of a Unix socket
pair to the rank (``Channel``) and its stdout and stderr as pipes the rank forwards line by
line to its own (so a ``decode_fn``'s prints reach the rank's log). ``serve`` runs
``decode_init_fn`` and answers ``ready`` (or ``failed`` with why); then each message holds one
batch or several (small batches travel together: ``pool.group_for``), each with its raw
values, row indices and names, the epoch, and which of the worker's slots to decode into.
The worker decodes and collates each as the rank's threads would (the same
``BatchDecoding``), its stacked columns straight into that slot's shared memory
(``SlotWriter``), and answers the message once: each batch's ``SlotBatch`` saying where its
tensors lie, or the ``Exception`` it raised (pickled where it can be, with its traceback),
and the worker's memory (``MemorySampler``).

The worker never outlives its rank: a thread reads the rank's messages as they come (so
the rank's sends never wait on a busy worker) and ends the process at once when the rank's
end of the socket closes, whatever the decoding is doing; and the kernel kills it when its
fork server ends (``PR_SET_PDEATHSIG``). It ignores SIGINT: a Ctrl-C in a terminal reaches
every process of the foreground group, and its rank decides how decoding ends. Anything
raised that is not an ``Exception`` (``SystemExit``, ``KeyboardInterrupt`` raised by the
user's code) ends the worker, which its rank reports as a worker that died, with its exit
status. It has one torch thread and no GPU (``CUDA_VISIBLE_DEVICES`` is empty).
"""

from __future__ import annotations

import os
import pickle
import queue
import threading
import time
import traceback

from . import batch_decoding
from .batch_decoding import BatchDecoding
from .batch_format import SlotWriter
from .channel import Channel
from .inbox import Inbox
from .shared_memory import SEGMENT_NAME

SAMPLE_EVERY_S = 5.0  # how often a worker reads its memory (a read costs 5 to 15 ms)
SEGMENT_NAME_BYTES = SEGMENT_NAME.encode()


def serve(channel: Channel, decoding: BatchDecoding) -> int:
    """Decode the rank's batches until it closes the socket or says ``close``; the exit
    status."""
    batch_decoding.IN_WORKER_PROCESS = True
    memory = MemorySampler()
    try:
        decoding.init()
    except Exception as e:
        channel.send(("failed", describe(e)))
        return 1
    channel.send(("ready", os.getpid(), memory.sample(force=True)))
    requests: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_receive, args=(channel, requests), daemon=True).start()
    writer, inbox = SlotWriter(), Inbox()
    while True:
        message, fds = requests.get()
        if message[0] == "close":
            return 0
        if message[0] == "map":  # a shared chunk segment of the rank's
            inbox.map_shared(message[1], message[2], fds[0])
            continue
        _, parts, forget = message
        inbox.unmap_shared(forget)
        outcomes, sent = decode_parts(decoding, writer, inbox, parts, list(fds))
        channel.send(("decoded", outcomes, memory.sample()), sent)


def decode_parts(
    decoding: BatchDecoding, writer: SlotWriter, inbox: Inbox, parts: list, fds: list[int]
) -> tuple[list[tuple], tuple[int, ...]]:
    """A message's batches (``parts``: each its seq, slot, epoch, values, ids, names and
    its input segment's size where it is new, whose descriptor is next in ``fds``), each
    decoded into its slot: (seq, "done", its ``SlotBatch``) or (seq, "error", the
    exception described), and the descriptors of the slots' new segments, in order."""
    outcomes, sent = [], []
    for seq, slot, epoch, values, ids, names, size in parts:
        given = [fds.pop(0)] if size is not None else []
        result = None  # the last batch's tensors, which may view a replaced segment, gone
        try:
            values, names = inbox.take(slot, size, given, values, names)
            decoding.allocate = writer.begin(slot)
            result = decoding.decode(values, ids, names, epoch)
            batch, new = writer.write(slot, result)
        except Exception as e:
            outcomes.append((seq, "error", describe(e)))
            continue
        outcomes.append((seq, "done", batch))
        sent.extend(new)
    return outcomes, tuple(sent)


def _receive(channel: Channel, requests: queue.SimpleQueue) -> None:
    """Hand the rank's messages to the decoding loop as they come; the rank gone, end."""
    try:
        while True:
            requests.put(channel.recv())
    except (EOFError, OSError):
        os._exit(0)


class MemorySampler:
    """This process's memory, read from ``/proc/self/smaps`` at most every
    ``SAMPLE_EVERY_S``: the peaks of its private memory (USS: the pages no other process
    maps, what it costs of its own; its slots' segments left out, which its rank maps too
    once it reads them), its proportional share (PSS: shared pages divided among the
    processes that map them) and its resident set (RSS, which counts every page it shares
    with its fork server and the other workers in full)."""

    def __init__(self):
        self.peaks = {"uss": 0, "pss": 0, "rss": 0}
        self.last = 0.0

    def sample(self, force: bool = False) -> dict[str, int]:
        now = time.monotonic()
        if force or now - self.last >= SAMPLE_EVERY_S:
            self.last = now
            for key, value in read_memory(os.getpid()).items():
                self.peaks[key] = max(self.peaks[key], value)
        return dict(self.peaks)


def read_memory(pid: int) -> dict[str, int]:
    """A process's USS (without the shared-memory segments it maps: ``SEGMENT_NAME``), PSS
    and RSS in bytes (zeros where ``/proc`` does not say)."""
    totals = {"uss": 0, "pss": 0, "rss": 0}
    segment = False
    try:
        with open(f"/proc/{pid}/smaps", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return totals
    for line in lines:
        if not line[:1].isupper():  # a mapping's first line: its addresses, ..., its name
            segment = SEGMENT_NAME_BYTES in line
        elif line.startswith((b"Private_Clean:", b"Private_Dirty:")):
            totals["uss"] += 0 if segment else int(line.split()[1]) * 1024
        elif line.startswith(b"Pss:"):
            totals["pss"] += int(line.split()[1]) * 1024
        elif line.startswith(b"Rss:"):
            totals["rss"] += int(line.split()[1]) * 1024
    return totals


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
