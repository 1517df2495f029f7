"""Executor: a rank's decode worker processes (``decode_pool="processes"``).

``DecodePool`` starts ``workers`` processes (``decode_worker``: a new interpreter each,
``python -m``, never a fork of the rank, which may hold a CUDA context), each with one end
of a Unix socket pair (``Channel``) and its stdout and stderr as pipes. ``decode_many``
keeps up to two batches in flight per worker, each whole batch one message (its raw
values, row indices and names: no Python per row here), and yields the results in the
batches' order: each batch's tensors are copied out of the worker's shared memory (into
pinned memory for a GPU) and the slot handed back at once. So the rank's Python per batch
does not grow with the batch's rows, and the order of rows, and each row's augmentation
(seeded by its index), are the rank's as before.

Failures: an exception the worker raised is raised here as it is (its traceback attached
as the cause); a worker that dies (killed, out of memory, a crash in native code) is
``DecodeWorkerDied`` within a second, naming the rank, the worker, the cause (its signal or
exit status and its last lines of stderr) and the batch's first row and its name. A pool is
closed with the rank (``close``): its workers are asked to end, then killed; a worker whose
rank dies first ends by itself (``decode_worker``). Their output lines reach the rank's
``sys.stdout`` / ``sys.stderr`` (the rank's log) through one thread.
"""

from __future__ import annotations

import collections
import os
import pickle
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch

from .columns import host_empty, place
from .decode_batch import BatchResult, Decoded, Recipe
from .decode_channel import Channel, Segment
from .decode_worker import SLOTS

T = TypeVar("T")
START_TIMEOUT_S = 300.0  # a worker's start: a new interpreter importing torch and the user's code
CLOSE_TIMEOUT_S = 5.0
TAIL_LINES = 20


class DecodeWorkerDied(RuntimeError):
    """A decode worker process ended while it held a batch (or before it started)."""


class WorkerTraceback(Exception):
    """The traceback of an exception raised in a decode worker (its cause, here)."""


class _Worker:
    def __init__(self, index: int, recipe: bytes, env: dict[str, str], label: str):
        self.index = index
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        module = "spark_estimator.worker.data.decode_worker"
        self.proc = subprocess.Popen(  # the label says whose worker it is in ps
            [sys.executable, "-m", module, str(theirs.fileno()), label],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        theirs.close()
        self.channel = Channel(ours)
        # sent while the worker starts (a recipe larger than the socket's buffer, a
        # tokenizer's vocabulary say, would otherwise wait for its imports, worker by worker)
        threading.Thread(target=self._send_recipe, args=(recipe,), daemon=True).start()
        self.pid = self.proc.pid
        self.ready = False
        self.free = list(range(SLOTS))
        self.segments: list[Segment | None] = [None] * SLOTS
        self.in_flight: dict[int, int] = {}  # seq -> slot
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.peak_rss = 0

    def _send_recipe(self, recipe: bytes) -> None:
        try:
            self.channel.send(("recipe", recipe))
        except OSError:  # it died starting: wait_ready says so, with its stderr
            pass

    def cause(self) -> str:
        """Why the process ended (or that it runs), and its last lines of stderr."""
        code = self.proc.poll()
        if code is None:
            why = "its socket closed while it runs"
        elif code < 0:
            name = signal.Signals(-code).name
            why = f"killed by {name}" + {
                "SIGKILL": " (out of memory, or killed from outside)",
                "SIGSEGV": " (a crash in native code)",
                "SIGBUS": " (a crash in native code, or shared memory that ran out)",
            }.get(name, "")
        else:
            why = f"exited with status {code}"
        tail = "\n".join(self.stderr_tail)
        return why + (f"; its last lines of stderr:\n{tail}" if tail else "")


class DecodePool:
    """``workers`` decode worker processes of one rank (see the module). ``recipe``: what
    they decode with; ``rank``: named in errors; ``pin``: copy batches out into pinned
    memory (for a GPU)."""

    def __init__(self, recipe: Recipe, workers: int, rank: int | str, pin: bool = False):
        self.rank, self.pin = rank, pin
        self.recipe = recipe
        data = pickle.dumps(recipe, protocol=pickle.HIGHEST_PROTOCOL)
        env = worker_environment()
        label = f"{'rank' if isinstance(rank, int) else 'for'}-{rank}".replace(" ", "-")
        self.workers = [_Worker(i, data, env, label) for i in range(workers)]
        self.results: dict[int, tuple[Any, Any]] = {}  # seq -> ("done", result) / ("error", e)
        self.firsts: dict[int, tuple[int | None, Any]] = {}  # seq -> its first row and name
        self.abandoned: set[int] = set()  # batches in flight whose results nobody reads
        self.seq = 0
        self.closed = False
        self.pump = _OutputPump(self.workers)

    # -- starting ---------------------------------------------------------------------------
    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until every worker has built its decoding (``decode_init_fn`` run)."""
        deadline = time.monotonic() + timeout
        while not all(w.ready for w in self.workers):
            left = deadline - time.monotonic()
            if left <= 0:
                slow = [w.index for w in self.workers if not w.ready]
                raise DecodeWorkerDied(
                    f"decode workers {slow} of {self._rank()} did not start in {timeout:.0f} s"
                )
            self._receive(min(left, 1.0))

    # -- decoding ---------------------------------------------------------------------------
    def decode_many(
        self,
        items: Iterable[T],
        raw: Callable[[T], tuple[dict, np.ndarray, np.ndarray | None, int | None]],
    ) -> Iterator[tuple[T, BatchResult]]:
        """Each of ``items`` with its batch decoded, in order; ``raw(item)`` gives the
        batch's values (column -> object array), row indices, names and epoch (None: not
        training). Items are drawn ahead, as many as the workers have slots."""
        self.wait_ready()
        pending: collections.deque[tuple[int, T]] = collections.deque()
        items = iter(items)
        exhausted = False
        try:
            while True:
                while not exhausted and len(pending) < len(self.workers) * SLOTS:
                    free = [w for w in self.workers if w.free]
                    if not free:
                        break
                    item = next(items, _END)
                    if item is _END:
                        exhausted = True
                        break
                    worker = min(free, key=lambda w: (len(w.in_flight), w.index))
                    pending.append((self._submit(worker, raw(item)), item))
                if not pending:
                    return
                seq, item = pending[0]
                if seq not in self.results:
                    self._receive(1.0)
                    continue
                pending.popleft()
                kind, value = self.results.pop(seq)
                if kind == "error":
                    raise value
                yield item, value
        finally:  # stopped early: what is still in flight is dropped when it comes
            for seq, _ in pending:
                if self.results.pop(seq, None) is None:
                    self.abandoned.add(seq)

    def _submit(self, worker: _Worker, raw: tuple) -> int:
        values, ids, names, epoch = raw
        slot = worker.free.pop()
        self.seq += 1
        seq = self.seq
        worker.in_flight[seq] = slot
        rows = len(ids)
        self.firsts[seq] = (
            int(ids[0]) if rows else None,
            names[0] if names is not None and rows else None,
        )
        worker.channel.send(("decode", seq, slot, epoch, values, ids, names))
        return seq

    def _receive(self, timeout: float) -> None:
        """Read what the workers have sent, waiting up to ``timeout``; a worker that died
        holding a batch (or before it started) is an error."""
        listening = [w for w in self.workers if w.in_flight or not w.ready]
        with selectors.DefaultSelector() as selector:
            for w in listening:
                selector.register(w.channel.sock, selectors.EVENT_READ, w)
            ready = selector.select(timeout) if listening else []
        for key, _ in ready:
            worker = key.data
            try:
                message, fds = worker.channel.recv()
            except (EOFError, OSError):
                self._died(worker)
            self._handle(worker, message, fds)
        for worker in listening:
            if worker.proc.poll() is not None:
                self._died(worker)

    def _handle(self, worker: _Worker, message, fds: list[int]) -> None:
        kind = message[0]
        if kind == "ready":
            worker.ready = True
            return
        if kind == "failed":
            raise _remote(
                message[1], f"decode worker {worker.index} of {self._rank()} could not start"
            )
        seq = message[1]
        slot = worker.in_flight.pop(seq)
        self.firsts.pop(seq, None)
        try:
            if kind == "done":
                _, _, reply, rss = message
                worker.peak_rss = max(worker.peak_rss, rss)
                if reply["segment"] is not None:
                    if worker.segments[slot] is not None:
                        worker.segments[slot].close()
                    worker.segments[slot] = Segment(reply["segment"], fds[0])
                if seq not in self.abandoned:
                    self.results[seq] = ("done", self._copied(reply, worker.segments[slot]))
            elif seq not in self.abandoned:
                self.results[seq] = ("error", _remote(message[2]))
        finally:
            worker.free.append(slot)
            self.abandoned.discard(seq)

    def _copied(self, reply: dict, segment: Segment | None) -> BatchResult:
        """The reply's batch in this process's memory (pinned with ``pin``)."""
        parts: dict[str, dict] = {"columns": {}, "masks": {}}
        for (where, name), value in reply["inline"].items():
            parts[where][name] = value
        for where, name, offset, dtype, shape, stride in reply["layout"]:
            # the tensor's memory as the worker laid it out, copied as it is (one memcpy,
            # NumPy's: single-threaded, without the GIL), then given its shape and strides
            dtype = getattr(torch, dtype.split(".")[-1])
            numel = int(torch.Size(shape).numel())
            flat = host_empty((numel,), dtype, self.pin and numel > 0)
            place(flat, segment.view(offset, dtype, (numel,)))
            parts[where][name] = flat.as_strided(shape, stride)
        decoded = None
        if reply["rows"] or parts["columns"]:
            columns = {n: parts["columns"][n] for n in reply["order"]}
            decoded = Decoded(columns, parts["masks"], reply["rows"])
        return BatchResult(decoded, reply["kept"], reply["skipped"], reply["padding"])

    def _died(self, worker: _Worker) -> None:
        try:
            worker.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            pass
        self.pump.drain(worker)
        what = "before it started"
        if worker.in_flight:
            row, name = self.firsts.get(min(worker.in_flight), (None, None))
            named = f" ({self.recipe.row_names} {name})" if name is not None else ""
            what = f"while decoding the batch whose first row is {row} of the split{named}"
        elif worker.ready:
            what = "between batches"
        raise DecodeWorkerDied(
            f"decode worker {worker.index} (pid {worker.pid}) of {self._rank()} died {what}: "
            f"{worker.cause()}"
        )

    def _rank(self) -> str:
        return f"rank {self.rank}" if isinstance(self.rank, int) else str(self.rank)

    # -- what it did, and its end -------------------------------------------------------------
    def peak_rss(self) -> list[int]:
        """Each worker's peak resident memory, in bytes, as last reported."""
        return [w.peak_rss for w in self.workers]

    def close(self) -> None:
        """End the workers: asked, then killed after ``CLOSE_TIMEOUT_S``."""
        if self.closed:
            return
        self.closed = True
        for worker in self.workers:
            try:
                worker.channel.send(("close",))
            except OSError:
                pass
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for worker in self.workers:
            try:
                worker.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait()
            worker.channel.close()
            for segment in worker.segments:
                if segment is not None:
                    segment.close()
        self.pump.join()

    def __del__(self):
        if not getattr(self, "closed", True):
            self.close()


_END = object()


def worker_environment() -> dict[str, str]:
    """A decode worker's environment: this process's, its ``sys.path`` (so it imports what
    the rank imports: the user's modules, Spark's files), one thread for each threaded
    library, no GPU, unbuffered output."""
    env = dict(os.environ)
    paths = [p for p in sys.path if isinstance(p, str)]
    env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in paths)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS"):
        env[name] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _remote(described, prefix: str | None = None) -> BaseException:
    """An exception a worker described (``decode_worker.describe``), its traceback as the
    cause."""
    data, name, message, text = described
    error = None
    if data is not None:
        try:
            error = pickle.loads(data)
        except Exception:
            error = None
    if error is None or prefix is not None:
        error = (
            DecodeWorkerDied(f"{prefix}: {name}: {message}")
            if prefix
            else RuntimeError(f"{name}: {message}")
        )
    error.__cause__ = WorkerTraceback("in the decode worker:\n" + text.rstrip())
    return error


class _OutputPump:
    """One thread that forwards the workers' output lines to this process's ``sys.stdout``
    and ``sys.stderr`` (looked up per line, so a rank's log capture gets them), and keeps
    each worker's last lines of stderr."""

    def __init__(self, workers: list[_Worker]):
        self.selector = selectors.DefaultSelector()
        self.partial: dict[int, bytes] = {}
        for w in workers:
            for stream, name in ((w.proc.stdout, "stdout"), (w.proc.stderr, "stderr")):
                os.set_blocking(stream.fileno(), False)
                self.selector.register(stream, selectors.EVENT_READ, (w, name))
        self.thread = threading.Thread(target=self._run, name="spark-estimator-decode-output")
        self.thread.daemon = True
        self.thread.start()

    def _run(self) -> None:
        while self.selector.get_map():
            for key, _ in self.selector.select(0.5):
                self._read(key)

    def _read(self, key) -> None:
        worker, name = key.data
        stream = key.fileobj
        try:
            data = os.read(stream.fileno(), 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        fd = stream.fileno()
        if not data:
            self.selector.unregister(stream)
            rest = self.partial.pop(fd, b"")
            if rest:
                self._line(worker, name, rest)
            return
        *lines, self.partial[fd] = (self.partial.get(fd, b"") + data).split(b"\n")
        for line in lines:
            self._line(worker, name, line)

    def _line(self, worker: _Worker, name: str, line: bytes) -> None:
        text = line.decode("utf-8", "replace")
        if name == "stderr":
            worker.stderr_tail.append(text)
        stream = sys.stdout if name == "stdout" else sys.stderr
        try:
            stream.write(text + "\n")
        except Exception:  # a closed stream at the end of a task: the line is lost
            pass

    def drain(self, worker: _Worker) -> None:
        """Wait (a second at most) until the pump has read what ``worker``, which died,
        wrote last: its last lines name the cause."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and any(
            key.data[0] is worker for key in list(self.selector.get_map().values())
        ):
            time.sleep(0.01)

    def join(self) -> None:
        self.thread.join(timeout=5.0)
