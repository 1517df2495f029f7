"""Executor: what a rank prints and logs, and how far training got, written to the store.

While a training task runs, ``RankLog`` copies the lines the process writes to
``sys.stdout`` and ``sys.stderr`` (they still reach the executor's own log too, unless not
``echo``: on a local master that log is the driver's terminal, which shows the lines from the
store already) and the records of Python ``logging`` (INFO and above, on the root logger;
counted as stderr, where logging writes by default; not those a handler on their way writes
to the captured stderr already, as the ``lightning`` package's does) into a buffer. A
background thread writes the buffer every ``CHUNK_S`` seconds (when it holds lines, and at
the end) as new chunk files, one per stream that has lines, so it works on stores that
cannot append (S3)::

    runs/<run_id>/logs/rank-<r>/<launch_id>-<task attempt id>-<seq>.log      stdout
    runs/<run_id>/logs/rank-<r>/<launch_id>-<task attempt id>-<seq>.err.log  stderr, logging

Lines keep their order within a stream; between the streams only to the chunk.

Lines leave the buffer only once written: a write that fails (a store that failed for a
moment) is tried again at the next flush, and the last one, at the end of the task, up to
``FINAL_ATTEMPTS`` times, so a failing rank's last lines reach its ``TrainingError``.

Rank 0 also reports progress (epoch, step, the epoch's running training loss, the last
epoch's record) in ``runs/<run_id>/progress.json``, rewritten every ``FLUSH_S`` seconds. The
driver's ``FitMonitor`` reads both while the job runs.
"""

from __future__ import annotations

import collections
import io
import logging
import posixpath
import sys
import threading
import time

from ...store import LOG_SUFFIX, Store

FLUSH_S = 0.5  # progress
CHUNK_S = 2.0  # output lines: a chattier pace would mean many small files in the store
FINAL_ATTEMPTS = 3  # writes of the last lines tried before the task ends without them
TAIL_LINES = 20  # the last lines a RankLog keeps in memory (a failing rank's error shows them)
_FORMAT = logging.Formatter("%(levelname)s %(name)s: %(message)s")


class _Tee(io.TextIOBase):
    """A text stream that writes through to ``stream`` (with ``echo``) and hands whole
    lines to ``sink`` (as ``sink(name, line)``, ``name`` being "stdout" or "stderr").

    Once its capture ended (``end``) it writes to ``sys.<name>`` as it is then: a logging
    handler made during one task on the captured ``sys.stderr`` (as the ``lightning``
    package makes one on import) keeps this stream after the task, and its lines belong to
    whichever task of the reused Python worker runs then."""

    def __init__(self, stream, sink, name: str, echo: bool = True):
        self.stream, self.sink, self.name, self.partial = stream, sink, name, ""
        self.echo, self.ended = echo, False

    def end(self) -> None:
        self.close_line()
        self.ended = True

    def write(self, text: str) -> int:
        if self.ended:
            now = getattr(sys, self.name)
            return (self.stream if now is self else now).write(text)
        if self.echo:
            self.stream.write(text)
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            self.sink(self.name, line)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def close_line(self) -> None:
        if self.partial:
            self.sink(self.name, self.partial)
            self.partial = ""

    def __getattr__(self, name):  # fileno, encoding, isatty: those of the real stream
        return getattr(self.stream, name)


class _Handler(logging.Handler):
    def __init__(self, sink):
        super().__init__(logging.INFO)
        self.sink = sink
        self.setFormatter(_FORMAT)

    def emit(self, record: logging.LogRecord) -> None:
        if _written_to_capture(record):
            return
        try:
            for line in self.format(record).split("\n"):
                self.sink("stderr", line)
        except Exception:
            self.handleError(record)


def _written_to_capture(record: logging.LogRecord) -> bool:
    """Whether a handler on the way from the record's logger to the root (as far as it
    propagates) writes it to a captured stream already (a ``_Tee``): the ``lightning``
    package's handler on its logger writes to ``sys.stderr``; a second line from the root
    would repeat each of its records."""
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None:
        for handler in logger.handlers:
            if (
                isinstance(getattr(handler, "stream", None), _Tee)
                and record.levelno >= handler.level
                and handler.filter(record)
            ):
                return True
        logger = logger.parent if logger.propagate else None
    return False


class OutputCapture:
    """Hands every line written to ``sys.stdout`` / ``sys.stderr`` (still written through,
    unless not ``echo``) and every root ``logging`` record at INFO and above to
    ``sink(stream, line)``, while entered (``stream``: "stdout", or "stderr" for stderr and
    logging)."""

    def __init__(self, sink, echo: bool = True):
        self.sink, self.echo = sink, echo

    def __enter__(self) -> OutputCapture:
        self.stdout, self.stderr = sys.stdout, sys.stderr
        sys.stdout = _Tee(sys.stdout, self.sink, "stdout", self.echo)
        sys.stderr = _Tee(sys.stderr, self.sink, "stderr", self.echo)
        root = logging.getLogger()
        self.handler, self.root_level = _Handler(self.sink), root.level
        root.addHandler(self.handler)
        if root.getEffectiveLevel() > logging.INFO:
            root.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        for tee in (sys.stdout, sys.stderr):
            if isinstance(tee, _Tee):
                tee.end()
        sys.stdout, sys.stderr = self.stdout, self.stderr
        root = logging.getLogger()
        root.removeHandler(self.handler)
        root.setLevel(self.root_level)


class RankLog:
    """Capture this rank's output and progress for the driver (a context manager)."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        launch_id: str,
        rank: int,
        attempt: int,
        echo: bool = True,
    ):
        """``echo``: the lines are also written to the task's own stdout and stderr (the
        executor's log), as without a RankLog."""
        self.store, self.rank, self.echo = store, rank, echo
        run = store.run(run_id)
        self.prefix = posixpath.join(run.rank_logs(rank), f"{launch_id}-{attempt:012d}-")
        self.progress_file = run.progress
        self.launch_id = launch_id
        self.lines: list[tuple[str, str]] = []  # (stream, line), not yet written
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.seq, self.chunk_written = 0, time.monotonic()
        self.lock = threading.Lock()
        self.writing = threading.Lock()  # one flush at a time (the thread's, write_now)
        self.progress: dict | None = None
        self.progress_written: dict | None = None
        self.stop = threading.Event()

    def add_line(self, stream: str, line: str) -> None:
        with self.lock:
            self.lines.append((stream, line))
            self.tail.append(line)

    def report(self, **progress) -> None:
        """Rank 0's progress (JSON values), written at the next flush."""
        if self.rank == 0:
            with self.lock:
                self.progress = {"launch_id": self.launch_id, **progress}

    def write_now(self) -> None:
        """Write the lines so far at once (best effort): the task failed, and Spark may
        kill its process before the block ends."""
        try:
            self.flush(final=True)
        except Exception as e:
            _report_unwritten(e)

    def flush(self, final: bool = False) -> None:
        with self.writing:
            self._flush(final)

    def _flush(self, final: bool) -> None:
        """Write new progress; new lines too at the end or after ``CHUNK_S`` seconds.

        Each stream's lines leave the buffer only once their chunk is written: after a failed
        write the next flush writes them again (under the same chunk name), with any newer
        lines. Chunk numbers rise with every file written, so their names sort in writing
        order."""
        chunk_due = final or time.monotonic() - self.chunk_written >= CHUNK_S
        with self.lock:
            lines = list(self.lines) if chunk_due else []
            progress = self.progress
        taken = len(lines)  # the buffer's first lines, those of this chunk
        for stream, suffix in LOG_SUFFIX.items():
            text = "".join(line + "\n" for s, line in lines if s == stream)
            if text:
                self.store.write_bytes(f"{self.prefix}{self.seq + 1:06d}{suffix}", text.encode())
                self.seq += 1
                self.chunk_written = time.monotonic()
                with self.lock:  # this stream's lines of the chunk leave the buffer
                    kept = [e for e in self.lines[:taken] if e[0] != stream]
                    self.lines[:taken] = kept
                    taken = len(kept)
        if progress is not None and progress != self.progress_written:
            self.store.write_json(self.progress_file, progress)
            self.progress_written = progress

    def _flush_loop(self) -> None:
        while not self.stop.wait(FLUSH_S):
            try:
                self.flush()
            except Exception as e:  # the store failed for a moment: the lines are kept
                _report_unwritten(e)

    def __enter__(self) -> RankLog:
        self.capture = OutputCapture(self.add_line, self.echo).__enter__()
        self.thread = threading.Thread(target=self._flush_loop, name="rank-log", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.capture.__exit__(*exc)
        self.stop.set()
        self.thread.join()
        for attempt in range(FINAL_ATTEMPTS):  # the last lines, the failing rank's included
            try:
                self.flush(final=True)
                return
            except Exception as e:  # never hide the task's own outcome behind the log's
                _report_unwritten(e)
                if attempt + 1 < FINAL_ATTEMPTS:
                    time.sleep(FLUSH_S)


def _report_unwritten(error: Exception) -> None:
    print(f"spark-estimator: could not write the rank's log: {error}", file=sys.__stderr__)
