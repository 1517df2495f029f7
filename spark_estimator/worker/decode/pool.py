"""Executor: a rank's batches scheduled over its decode worker processes
(``decode_pool="processes"``).

``DecodePool.decode_many`` hands batches to a worker with free slots, each batch whole (its
raw values, row indices and names; its rows of bytes through shared memory: ``inbox``),
``group`` of them a message (``group_for``: small batches travel together, so that what a
message costs, sent, received, woken for, is paid once for ``GROUP_ROWS`` rows or so;
fewer at the end of a pass that says how many batches are left, so that its last batches
are spread over the workers), at most ``IN_FLIGHT`` messages a worker, and yields the
results in the batches' order. A worker answers a message once, with all its batches; they
come back through the processes' thread (``WorkerProcesses``), which takes each batch out
of its slot the rank's way (``Delivery``: views of the slot on a CPU, copies straight to
the GPU from the slot, pinned copies for transform) as it arrives, so the consuming thread
only waits for them.
A worker has up to ``(IN_FLIGHT + VIEWED) * group`` slots: while the rank holds views of
``VIEWED * group`` of its batches (the one training and those arrived with it or after),
it still has ``IN_FLIGHT * group`` to decode into; a batch beyond that is copied out, so
the workers never wait on a batch the rank's code keeps. So the rank's Python calls per
batch do not grow with its rows (its one loop over them copies their bytes), and the order
of rows and each row's augmentation (seeded by its index) are the rank's as before.

Failures: an exception the worker raised is raised here as it is (its traceback as the
cause); a worker that dies, busy or idle, is ``DecodeWorkerDied`` naming the rank, the
worker, the cause (its signal or exit status and its last lines of stderr) and, if it held
one, the batch's first row and its name (those of every batch of its message: which one it
died in, it cannot tell); a batch that does not arrive within ``timeout`` seconds
(``decode_timeout``, times the batches of its message, which arrive together) is
``DecodeTimeout``, naming the same. A pass stopped early leaves its batches in flight to be
dropped as they come; a pass started meanwhile waits for the slots they hold.
"""

from __future__ import annotations

import collections
import operator
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import numpy as np

from .decoded import BatchResult, Recipe
from .delivery import Delivery
from .inbox import Inboxes
from .processes import START_TIMEOUT_S, DecodeWorkerDied, Worker, WorkerProcesses, remote
from .shared_memory import Segment
from .shared_rows import InShared, SharedRows

T = TypeVar("T")
IN_FLIGHT = 2  # messages a worker holds at once: one decoded while the rank reads the other
VIEWED = 2  # a worker's messages' batches the rank may hold as views of its slots ("view")
COPYING = 1  # a worker's messages whose batches are still being copied out (other deliveries)
GROUP_ROWS = 256  # the rows a message holds at least, where batches are smaller (``group_for``)
GROUP_MOST = 8  # the most batches a message holds


class DecodeTimeout(TimeoutError):
    """A batch did not arrive from its decode worker within ``decode_timeout`` seconds."""


class _Slots:
    """A worker's slots: free, in flight (by batch), viewed by the rank, their segments."""

    def __init__(self):
        self.free: list[int] = []
        self.in_flight: dict[int, int] = {}  # seq -> slot
        self.viewed: set[int] = set()
        self.made = 0
        self.segments: dict[int, Segment] = {}


class DecodePool:
    """``workers`` decode worker processes of one rank (see the module). ``recipe``: what
    they decode with; ``rank``: named in errors; ``delivery``: how batches are taken out of
    their slots; ``timeout``: the seconds a batch may take (None: no limit); ``group``: the
    batches a message holds (``group_for``)."""

    def __init__(
        self,
        recipe: Recipe,
        workers: int,
        rank: int | str,
        delivery: Delivery | None = None,
        timeout: float | None = None,
        group: int = 1,
    ):
        self.recipe, self.timeout = recipe, timeout
        self.delivery = delivery or Delivery("view")
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.regroup(group)  # self.group, self.most_slots
        self.slots = {i: _Slots() for i in range(workers)}
        self.results: dict[int, tuple[str, Any]] = {}  # seq -> ("done", result) / ("error", e)
        self.firsts: dict[int, tuple[int | None, Any]] = {}  # seq -> its first row and name
        self.together: dict[int, int] = {}  # seq -> the batches of its message
        self.abandoned: set[int] = set()  # batches in flight whose results nobody reads
        self.released: queue.SimpleQueue = queue.SimpleQueue()  # (worker, slot) given back
        self.failure: BaseException | None = None
        self.inline_reason: str | None = None
        self.seq = 0
        self.closed = False
        self.inboxes = Inboxes()  # the batches' rows of bytes, in shared memory
        self.shared = SharedRows(self._announce)  # the loader's chunks' bytes, as read
        self.gone_seen = dict.fromkeys(range(workers), 0)  # closed segments each was told of
        self.holding: dict[int, dict] = {}  # seq -> its rows in shared chunks, until done
        self._rank = rank
        label = f"{'rank' if isinstance(rank, int) else 'for'}-{rank}".replace(" ", "-")
        self.processes = WorkerProcesses(
            recipe,
            workers,
            label,
            self._who(),
            self.changed,
            self._arrived,
            self._died,
            self.delivery.poll,
            self.delivery.busy,
        )

    def regroup(self, group: int) -> None:
        """Send ``group`` batches a message from the next pass on (with as many slots)."""
        if group < 1:
            raise ValueError(f"group: a message holds one batch or more, got {group}")
        with self.changed:
            self.group = group
            self.most_slots = slots_per_worker(self.delivery.mode, group)

    @property
    def rank(self) -> int | str:
        return self._rank

    @rank.setter
    def rank(self, rank: int | str) -> None:
        self._rank = rank
        self.processes.who = self._who()

    def _who(self) -> str:
        return f"rank {self._rank}" if isinstance(self._rank, int) else str(self._rank)

    # -- starting -------------------------------------------------------------------------------
    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until every worker has built its decoding (``decode_init_fn`` run)."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not self.processes.all_ready():
                self._check()
                left = deadline - time.monotonic()
                if left <= 0:
                    slow = self.processes.count - sum(
                        w.ready for w in self.processes.workers.values()
                    )
                    raise DecodeWorkerDied(
                        f"{slow} decode workers of {self._who()} did not start in {timeout:.0f} s"
                    )
                self.changed.wait(min(left, 1.0))

    # -- decoding -------------------------------------------------------------------------------
    def decode_many(
        self,
        items: Iterable[T],
        raw: Callable[[T], tuple[dict, np.ndarray, np.ndarray | None, int | None]],
    ) -> Iterator[tuple[T, BatchResult]]:
        """Each of ``items`` with its batch decoded, in order; ``raw(item)`` gives the
        batch's values (column -> object array), row indices, names and epoch (None: not
        training). Items are drawn ahead, as many as the workers have slots for."""
        self.wait_ready()
        pending: collections.deque[tuple[int, T]] = collections.deque()
        items = iter(items)
        exhausted = False
        try:
            while True:
                if not exhausted and len(pending) < len(self.slots) * IN_FLIGHT * self.group:
                    with self.changed:
                        self._check()
                        taken = self._take_slots(self._most(operator.length_hint(items, -1)))
                    if taken is not None:
                        worker, slots = taken
                        drawn, exhausted = self._draw(items, worker, slots)
                        if drawn:
                            raws = [raw(i) for i in drawn]
                            seqs = self._submit(worker, slots[: len(drawn)], raws)
                            pending.extend(zip(seqs, drawn))
                        continue
                if not pending:
                    if exhausted:
                        return
                    with self.changed:  # every slot held (viewed, or an abandoned pass's)
                        self._check()
                        self.changed.wait(0.02)
                    continue
                seq, item = pending[0]
                kind, value = self._wait(seq)
                pending.popleft()
                if kind == "error":
                    raise value
                yield item, value
                item = value = None  # not kept by this frame (a traceback keeps frames)
        finally:  # stopped early: what is still in flight is dropped when it comes
            with self.changed:
                for seq, _ in pending:
                    if self.results.pop(seq, None) is None:
                        self.abandoned.add(seq)

    def _draw(self, items: Iterator[T], worker: Worker, slots: list[int]) -> tuple[list[T], bool]:
        """An item for each of ``worker``'s ``slots`` taken, while there are items (the
        first ones' slots; those left over given back); and whether the items ran out."""
        drawn: list[T] = []
        try:
            for _ in slots:
                item = next(items, _END)
                if item is _END:
                    break
                drawn.append(item)
        except BaseException:
            self._untake(worker, slots)
            raise
        if len(drawn) < len(slots):
            self._untake(worker, slots[len(drawn) :])
            return drawn, True
        return drawn, False

    def _most(self, left: int) -> int:
        """The batches the next message may hold, ``left`` batches of the pass to come (-1:
        not known): ``group``, and at a pass's end no more than each worker's share of what
        is left, so that its last batches are spread over the workers rather than sent to
        one of them together."""
        if left < 0:
            return self.group
        return max(1, min(self.group, left // len(self.slots)))

    def _take_slots(self, most: int) -> tuple[Worker, list[int]] | None:
        """The worker with the fewest batches in flight that has room for more and the slots
        (up to ``most``) it decodes them into, taken (the lock held); None where no worker
        has one."""
        self._take_back()
        best = None
        for index, slots in self.slots.items():
            worker = self.processes.workers.get(index)
            if worker is None or len(slots.in_flight) >= IN_FLIGHT * self.group:
                continue
            if not slots.free and slots.made >= self.most_slots:
                continue
            if best is None or len(slots.in_flight) < len(self.slots[best.index].in_flight):
                best = worker
        if best is None:
            return None
        slots = self.slots[best.index]
        room = min(most, IN_FLIGHT * self.group - len(slots.in_flight))
        taken = [slots.free.pop() for _ in range(min(room, len(slots.free)))]
        while len(taken) < room and slots.made < self.most_slots:
            taken.append(slots.made)
            slots.made += 1
        return best, taken

    def _untake(self, worker: Worker, taken: list[int]) -> None:
        with self.changed:
            self.slots[worker.index].free.extend(taken)

    def _take_back(self) -> None:
        """The slots given back since (the lock held)."""
        while True:
            try:
                index, slot = self.released.get_nowait()
            except queue.Empty:
                return
            slots = self.slots[index]
            slots.viewed.discard(slot)
            slots.free.append(slot)

    def _submit(self, worker: Worker, slots: list[int], raws: list[tuple]) -> list[int]:
        """The batches of ``raws`` sent to ``worker`` in one message, each to decode into its
        slot of ``slots``: their seqs."""
        seqs = []
        with self.changed:
            for slot, (_, ids, names, _) in zip(slots, raws):
                self.seq += 1
                seqs.append(self.seq)
                self.slots[worker.index].in_flight[self.seq] = slot
                self.together[self.seq] = len(raws)
                self.firsts[self.seq] = (
                    int(ids[0]) if len(ids) else None,
                    names[0] if names is not None and len(ids) else None,
                )
        try:
            parts, fds = [], []
            for seq, slot, raw in zip(seqs, slots, raws):
                part, new = self._part(worker, seq, slot, raw)
                parts.append(part)
                fds.extend(new)
            forget, self.gone_seen[worker.index] = self.shared.gone_since(
                self.gone_seen[worker.index]
            )
            worker.channel.send(("decode", parts, forget), tuple(fds))
        except OSError:  # it died before these batches: the processes' thread finds out how
            with self.changed:
                for seq in seqs:
                    self.slots[worker.index].in_flight.pop(seq, None)
                    self.holding.pop(seq, None)
                    self.together.pop(seq, None)
        return seqs

    def _part(self, worker: Worker, seq: int, slot: int, raw: tuple) -> tuple[tuple, tuple]:
        """Batch ``seq``'s part of a message to ``worker`` and the descriptor it carries, if
        any: its rows of bytes described where they are in shared chunk segments
        (``shared_rows``; held here until the worker answers), the others copied into the
        slot's input segment (``inbox``)."""
        values, ids, names, epoch = raw
        sent = self.shared.describe(values)
        if any(isinstance(v, InShared) for v in sent.values()):
            with self.changed:
                self.holding[seq] = values
        sent, names, size, fds = self.inboxes.post((worker.index, slot), sent, names)
        return (seq, slot, epoch, sent, ids, names, size), fds

    def _announce(self, key: int, size: int, fd: int) -> None:
        """Tell every worker of a new shared chunk segment (its descriptor along)."""
        for worker in list(self.processes.workers.values()):
            try:
                worker.channel.send(("map", key, size), (fd,))
            except OSError:  # it died: the processes' thread says how
                pass

    def _wait(self, seq: int) -> tuple[str, Any]:
        """Batch ``seq``'s result, waited for (``timeout`` seconds at most)."""
        with self.changed:
            together = self.together.get(seq, 1)
            deadline = None
            if self.timeout is not None:
                deadline = time.monotonic() + self.timeout * together
            while seq not in self.results:
                self._check()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self.failure = self._timed_out(seq)
                    raise self.failure
                self.changed.wait(1.0 if left is None else min(left, 1.0))
            return self.results.pop(seq)

    def _check(self) -> None:
        """Raise what failed (the lock held)."""
        failure = self.failure or self.processes.failure
        if failure is not None:
            raise failure
        if self.closed:
            raise DecodeWorkerDied(f"the decode workers of {self._who()} were closed")

    def _timed_out(self, seq: int) -> DecodeTimeout:
        index = next(i for i, s in self.slots.items() if seq in s.in_flight)
        worker = self.processes.workers[index]
        together = self.together.get(seq, 1)
        took = f"more than {self.timeout:g} s on {self._batch_named(seq)}"
        if together > 1:
            took = (
                f"more than {self.timeout * together:g} s on {self._batch_named(seq)} and the "
                f"{together - 1} sent with it ({self.timeout:g} s a batch)"
            )
        return DecodeTimeout(
            f"decode_timeout: decode worker {index} (pid {worker.pid}) of {self._who()} took "
            f"{took}; the workers are stopped. Find what the decoding waits on there (a slow "
            "or stuck read, a lock), or raise decode_timeout"
        )

    def _batch_named(self, seq: int) -> str:
        row, name = self.firsts.get(seq, (None, None))
        named = f" ({self.recipe.row_names} {name})" if name is not None else ""
        return f"the batch whose first row is {row} of the split{named}"

    def _row_named(self, seq: int) -> str:
        row, name = self.firsts.get(seq, (None, None))
        return f"{row}" + (f" ({self.recipe.row_names} {name})" if name is not None else "")

    # -- the processes' thread ------------------------------------------------------------------
    def _arrived(self, worker: Worker, outcomes: list[tuple], fds: list[int]) -> None:
        """What a worker ``decoded`` (a message's batches: each done or failed): each batch
        taken out of its slot and kept for its pass (or its slot given back, for an
        abandoned pass); the consuming thread woken once."""
        fds = list(fds)
        results = [self._outcome(worker, *outcome, fds) for outcome in outcomes]
        with self.changed:
            for seq, result in results:
                if result is not None:
                    self.results[seq] = result
            self.changed.notify_all()

    def _outcome(
        self, worker: Worker, seq: int, kind: str, value: Any, fds: list[int]
    ) -> tuple[int, tuple[str, Any] | None]:
        """Batch ``seq`` out of its slot: ("done", its result) or ("error", the exception
        raised); None for an abandoned pass's (its slot given back). ``fds``: the message's
        descriptors of new slot segments, this batch's taken first."""
        slots = self.slots[worker.index]
        with self.changed:
            slot = slots.in_flight.pop(seq)
            self.holding.pop(seq, None)
            self.together.pop(seq, None)
            abandoned = seq in self.abandoned
            self.abandoned.discard(seq)
            self.firsts.pop(seq, None)
            view = (
                self.delivery.mode == "view"
                and not abandoned
                and len(slots.viewed) < VIEWED * self.group
            )
            if view:
                slots.viewed.add(slot)

        def release(index: int = worker.index, slot: int = slot) -> None:
            self.released.put((index, slot))

        if kind != "done":
            release()
            return seq, None if abandoned else ("error", remote(value))
        if value.segment_size is not None:
            self._replace(slots, slot, Segment(value.segment_size, fds.pop(0)))
        if value.inline_reason is not None:
            self.inline_reason = value.inline_reason
        if abandoned:
            release()
            return seq, None
        return seq, ("done", self.delivery.take(value, slots.segments.get(slot), release, view))

    def _replace(self, slots: _Slots, slot: int, segment: Segment) -> None:
        old = slots.segments.get(slot)
        if old is not None:
            self.delivery.forget(old)
            old.close()  # its memory goes with the last view of it
        slots.segments[slot] = segment

    def _died(self, worker: Worker) -> None:
        with self.changed:
            in_flight = self.slots[worker.index].in_flight
            what = "before it started"
            if in_flight:
                first = min(in_flight)  # its message's batches: the seqs from it on
                what = f"while decoding {self._batch_named(first)}"
                sent = range(first + 1, first + self.together.get(first, 1))
                if sent:
                    what += f" or one of the {len(sent)} sent with it, whose first rows are "
                    what += ", ".join(self._row_named(s) for s in sent)
            elif worker.ready:
                what = "between batches"
            self.failure = self.failure or DecodeWorkerDied(
                f"decode worker {worker.index} (pid {worker.pid}) of {self._who()} died "
                f"{what}: {worker.cause()}"
            )
            self.changed.notify_all()

    # -- what it did, and its end ---------------------------------------------------------------
    def summary(self) -> dict:
        """Each worker's peak memory (USS, PSS, RSS, in bytes, as last reported) and its
        start (seconds)."""
        workers = [self.processes.workers[i] for i in sorted(self.processes.workers)]
        out = {
            "worker_uss_bytes": [w.memory["uss"] for w in workers],
            "worker_pss_bytes": [w.memory["pss"] for w in workers],
            "worker_rss_bytes": [w.memory["rss"] for w in workers],
            "worker_start_seconds": self.processes.start_seconds(),
        }
        if self.inline_reason:
            out["inline_reason"] = self.inline_reason
        return out

    def close(self) -> None:
        """End the workers (without waiting behind their batches) and free the slots."""
        if self.closed:
            return
        with self.changed:
            self.closed = True
            self.changed.notify_all()
        self.processes.close()
        with self.changed:
            self.results.clear()  # batches no pass will read (their views of the slots)
        self.delivery.close()
        for slots in self.slots.values():
            for segment in slots.segments.values():
                segment.close()
        self.inboxes.close()
        self.holding.clear()
        self.shared.close()

    def __del__(self):
        if not getattr(self, "closed", True):
            self.close()


_END = object()


def slots_per_worker(delivery: str, group: int = 1) -> int:
    """The most slots a worker makes, with ``group`` batches a message: those it decodes
    into, and those the rank holds as views (delivery "view") or is still copying out of
    (the others)."""
    return (IN_FLIGHT + (VIEWED if delivery == "view" else COPYING)) * group


def group_for(batch_rows: int) -> int:
    """The batches a message to a worker holds, for batches of ``batch_rows`` rows: as many
    as make ``GROUP_ROWS`` rows (at most ``GROUP_MOST``), one where a batch has as many."""
    return max(1, min(GROUP_MOST, GROUP_ROWS // max(1, batch_rows)))
