"""Executor: a rank's decode worker processes, from their start to their end.

``WorkerProcesses`` starts the rank's fork server (``fork_server``: a new interpreter,
``python -m``, never a fork of the rank, which may hold a CUDA context), sends it the
recipe and asks it for ``count`` workers, each forked from it. One thread of the rank
(``spark-estimator-decode``) then reads everything the server and the workers send: the
server's ``forked`` (a worker's pid, and the rank's ends of its socket and pipes) and
``exited`` (a worker's exit status), the workers' ``ready`` and their batches, which it
hands to the pool (``on_batch``) as they come, so that a batch is taken out of shared
memory while the rank's training thread does other things. Another thread forwards the
server's and the workers' output lines to the rank's ``sys.stdout`` / ``sys.stderr`` (the
rank's log) and keeps each one's last lines of stderr.

A worker whose socket closes while the pool runs has died: once its server has said how
(or after ``STATUS_WAIT_S``) the pool is told (``on_death``), and names it with its cause
(its signal or exit status, its last lines of stderr). ``close`` ends all of it without
waiting behind any batch: the workers' sockets are shut first (each worker ends at once,
mid-batch), then the server is asked to end, and every wait is bounded.
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
from collections.abc import Callable

from .channel import Channel
from .decoded import Recipe

START_TIMEOUT_S = 300.0  # the server's start: a new interpreter importing torch and the user's code
CLOSE_TIMEOUT_S = 5.0
STATUS_WAIT_S = 2.0  # how long a dead worker's exit status is waited for
TAIL_LINES = 20
SERVER = "spark_estimator.worker.decode.fork_server"


class DecodeWorkerDied(RuntimeError):
    """A decode worker process (or its fork server) ended while its rank decoded."""


class WorkerTraceback(Exception):
    """The traceback of an exception raised in a decode worker (its cause, here)."""


class Worker:
    """A decode worker process as its rank sees it."""

    def __init__(self, index: int, pid: int, channel: Channel):
        self.index, self.pid, self.channel = index, pid, channel
        self.ready = False
        self.ready_at: float | None = None
        self.status: int | None = None  # how it ended (``os.waitpid``'s), told by its server
        self.gone = False  # its socket closed
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.memory = {"uss": 0, "pss": 0, "rss": 0}  # peaks, as it last reported them

    def cause(self) -> str:
        """How the process ended (or that it runs), and its last lines of stderr."""
        status = self.status
        if status is None:
            why = "its socket closed while it runs"
        elif os.WIFSIGNALED(status):
            name = signal.Signals(os.WTERMSIG(status)).name
            why = f"killed by {name}" + {
                "SIGKILL": " (out of memory, or killed from outside)",
                "SIGSEGV": " (a crash in native code)",
                "SIGBUS": " (a crash in native code, or shared memory that ran out)",
            }.get(name, "")
        else:
            why = f"exited with status {os.WEXITSTATUS(status)}"
        tail = "\n".join(self.stderr_tail)
        return why + (f"; its last lines of stderr:\n{tail}" if tail else "")


class WorkerProcesses:
    """A rank's fork server and its ``count`` decode workers (see the module). ``label``
    names them in ``ps``, ``who`` in errors; ``changed`` is the pool's condition, notified
    whenever a worker starts, fails or dies; ``on_batch(worker, outcomes, fds)`` takes
    what a worker ``decoded`` (a message's batches), ``on_death(worker)`` a worker that
    died, ``on_tick()`` runs after every wake of the thread (every ``tick`` seconds at
    least while ``ticking()``)."""

    def __init__(
        self,
        recipe: Recipe,
        count: int,
        label: str,
        who: str,
        changed: threading.Condition,
        on_batch: Callable[[Worker, tuple, list[int]], None],
        on_death: Callable[[Worker], None],
        on_tick: Callable[[], None] = lambda: None,
        ticking: Callable[[], bool] = lambda: False,
    ):
        self.count, self.who, self.changed = count, who, changed
        self.on_batch, self.on_death, self.on_tick, self.ticking = (
            on_batch,
            on_death,
            on_tick,
            ticking,
        )
        self.started = time.monotonic()
        self.workers: dict[int, Worker] = {}  # by index, once forked
        self.by_pid: dict[int, Worker] = {}
        self.failure: BaseException | None = None
        self.server_ready = False
        self.closing = self.closed = False
        self.dying: dict[Worker, float] = {}  # dead workers whose exit status is awaited
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server = subprocess.Popen(  # the label says whose server it is in ps
            [sys.executable, "-m", SERVER, str(theirs.fileno()), label],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=worker_environment(),
        )
        theirs.close()
        self.server_channel = Channel(ours)
        self.server_tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.pump = OutputPump()
        for stream, name in ((self.server.stdout, "stdout"), (self.server.stderr, "stderr")):
            self.pump.add(stream.fileno(), None, name, self.server_tail, owned=False)
        self.wake_r, self.wake_w = os.pipe()
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.server_channel.sock, selectors.EVENT_READ, "server")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")
        data = pickle.dumps(recipe, protocol=pickle.HIGHEST_PROTOCOL)
        # sent while the server starts (a recipe larger than the socket's buffer, a
        # tokenizer's vocabulary say, would otherwise wait for its imports)
        threading.Thread(target=self._start, args=(data,), daemon=True).start()
        self.thread = threading.Thread(target=self._run, name="spark-estimator-decode")
        self.thread.daemon = True
        self.thread.start()

    def _start(self, recipe: bytes) -> None:
        try:
            self.server_channel.send(("recipe", recipe))
            for _ in range(self.count):
                self.server_channel.send(("fork",))
        except OSError:  # it died starting: its exit says so
            pass

    # -- the thread that reads ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self.closed:
                timeout = 0.02 if self.dying or self.ticking() else 1.0
                for key, _ in self.selector.select(timeout):
                    if key.data == "wake":
                        os.read(self.wake_r, 64)
                    elif key.data == "server":
                        self._from_server()
                    else:
                        self._from_worker(key.data)
                self._check_dying()
                self.on_tick()
        except Exception as e:  # the pool's own failure: raised to the rank
            with self.changed:
                if not self.closing:
                    self.failure = self.failure or e
                self.changed.notify_all()

    def _from_server(self) -> None:
        try:
            message, fds = self.server_channel.recv()
        except (EOFError, OSError):
            self.selector.unregister(self.server_channel.sock)
            self._server_gone()
            return
        kind = message[0]
        with self.changed:
            if kind == "ready":
                self.server_ready = True
            elif kind == "failed":
                prefix = f"decode workers of {self.who} could not start"
                self.failure = remote(message[1], prefix)
            elif kind == "forked":
                channel = Channel(socket.socket(fileno=fds[0]))
                worker = Worker(len(self.workers), message[1], channel)
                self.workers[worker.index] = worker
                self.by_pid[worker.pid] = worker
                self.selector.register(worker.channel.sock, selectors.EVENT_READ, worker)
                self.pump.add(fds[1], worker, "stdout", None)
                self.pump.add(fds[2], worker, "stderr", worker.stderr_tail)
            elif kind == "exited" and message[1] in self.by_pid:
                self.by_pid[message[1]].status = message[2]
            self.changed.notify_all()

    def _server_gone(self) -> None:
        if self.closing:
            return
        try:
            self.server.wait(timeout=STATUS_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        self.pump.drain(None)
        code = self.server.poll()
        why = "its socket closed while it runs" if code is None else _ended(code)
        tail = "\n".join(self.server_tail)
        with self.changed:
            self.failure = self.failure or DecodeWorkerDied(
                f"the decode workers' fork server (pid {self.server.pid}) of {self.who} "
                f"died: {why}" + (f"; its last lines of stderr:\n{tail}" if tail else "")
            )
            self.changed.notify_all()

    def _from_worker(self, worker: Worker) -> None:
        try:
            message, fds = worker.channel.recv()
        except (EOFError, OSError):
            self.selector.unregister(worker.channel.sock)
            with self.changed:
                worker.gone = True
                if not self.closing:
                    self.dying[worker] = time.monotonic() + STATUS_WAIT_S
            return
        kind = message[0]
        if kind == "decoded":
            worker.memory = message[2]
            self.on_batch(worker, message[1], fds)
            return
        with self.changed:
            if kind == "ready":
                worker.ready, worker.ready_at = True, time.monotonic()
                worker.memory = message[2]
            elif kind == "failed":
                prefix = f"decode worker {worker.index} of {self.who} could not start"
                self.failure = self.failure or remote(message[1], prefix)
            self.changed.notify_all()

    def _check_dying(self) -> None:
        now = time.monotonic()
        for worker, deadline in list(self.dying.items()):
            if worker.status is not None or now >= deadline:
                del self.dying[worker]
                self.pump.drain(worker)
                self.on_death(worker)

    # -- what the pool asks -------------------------------------------------------------------
    def all_ready(self) -> bool:
        return len(self.workers) == self.count and all(w.ready for w in self.workers.values())

    def start_seconds(self) -> list[float]:
        """Each worker's start: the seconds from the pool's start until it was ready."""
        return [
            round(w.ready_at - self.started, 3)
            for w in self.workers.values()
            if w.ready_at is not None
        ]

    def close(self) -> None:
        """End the workers and their server (see the module); every wait bounded."""
        if self.closed:
            return
        with self.changed:
            self.closing = True
            self.changed.notify_all()
        for worker in list(self.workers.values()):
            _shut(worker.channel.sock)  # the worker ends at once, whatever it was doing
        try:
            self.server_channel.send(("close",))
        except OSError:
            pass
        self.closed = True
        os.write(self.wake_w, b"x")
        self.thread.join(timeout=CLOSE_TIMEOUT_S)
        try:
            self.server.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.server.kill()  # its workers are killed with it (PR_SET_PDEATHSIG)
            self.server.wait()
        for worker in self.workers.values():
            worker.channel.close()
        self.server_channel.close()
        self.pump.join()
        for stream in (self.server.stdout, self.server.stderr):
            stream.close()
        self.selector.close()
        os.close(self.wake_r)
        os.close(self.wake_w)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _ended(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def worker_environment() -> dict[str, str]:
    """The fork server's (and so its workers') environment: this process's, its
    ``sys.path`` (so it imports what the rank imports: the user's modules, Spark's files),
    one thread for each threaded library, no GPU, unbuffered output."""
    env = dict(os.environ)
    paths = [p for p in sys.path if isinstance(p, str)]
    env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in paths)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS"):
        env[name] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONUNBUFFERED"] = "1"
    return env


def remote(described, prefix: str | None = None) -> BaseException:
    """An exception a worker described (``worker_process.describe``), its traceback as the
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


class OutputPump:
    """One thread that forwards output lines to this process's ``sys.stdout`` and
    ``sys.stderr`` (looked up per line, so a rank's log capture gets them), keeping the last
    lines of each stream given a ``tail``."""

    def __init__(self):
        self.selector = selectors.DefaultSelector()
        self.partial: dict[int, bytes] = {}
        self.thread = threading.Thread(target=self._run, name="spark-estimator-decode-output")
        self.thread.daemon = True
        self.started = False

    def add(
        self, fd: int, owner, name: str, tail: collections.deque | None, owned: bool = True
    ) -> None:
        """Forward the lines read from ``fd`` (``owner``'s ``name`` stream); closed at its
        end where ``owned`` (else its file object closes it)."""
        os.set_blocking(fd, False)
        self.selector.register(fd, selectors.EVENT_READ, (owner, name, tail, owned))
        if not self.started:
            self.started = True
            self.thread.start()

    def _run(self) -> None:
        while self.selector.get_map():
            for key, _ in self.selector.select(0.5):
                self._read(key)

    def _read(self, key) -> None:
        owner, name, tail, owned = key.data
        fd = key.fd
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.selector.unregister(fd)
            if owned:
                os.close(fd)
            rest = self.partial.pop(fd, b"")
            if rest:
                self._line(name, tail, rest)
            return
        *lines, self.partial[fd] = (self.partial.get(fd, b"") + data).split(b"\n")
        for line in lines:
            self._line(name, tail, line)

    def _line(self, name: str, tail: collections.deque | None, line: bytes) -> None:
        text = line.decode("utf-8", "replace")
        if tail is not None and name == "stderr":
            tail.append(text)
        stream = sys.stdout if name == "stdout" else sys.stderr
        try:
            stream.write(text + "\n")
        except Exception:  # a closed stream at the end of a task: the line is lost
            pass

    def drain(self, owner) -> None:
        """Wait (a second at most) until the pump has read what ``owner``, which ended,
        wrote last: its last lines name the cause."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and any(
            key.data[0] is owner for key in list(self.selector.get_map().values())
        ):
            time.sleep(0.01)

    def join(self) -> None:
        if self.started:
            self.thread.join(timeout=CLOSE_TIMEOUT_S)
