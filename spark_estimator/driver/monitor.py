"""Driver: follow a running fit through the store: progress bar and the ranks' output.

While the training job runs, a thread reads what the ranks write (``RankLog``)
every ``POLL_S`` seconds:

- each new chunk of a rank's output is logged, line by line, as ``[rank <r>] <line>`` on
  the ``spark_estimator.worker`` logger (INFO); with ``verbose`` and no logging configured
  for that logger, the lines are also printed (to stderr) above the progress bar. A
  ``show(rank, stream, line)`` given instead receives each line with its stream ("stdout"
  or "stderr": ``run`` sends them to its ``stdout`` / ``stderr``);
- with ``verbose``, rank 0's ``progress.json`` drives a tqdm bar (a widget in Jupyter, text
  in a terminal): steps over all epochs, the epoch, the running training loss and the last
  epoch's validation loss. The bar starts at the first step the driver sees (``initial``),
  so its rate counts only the steps it saw being done, not those before it appeared.

In Jupyter the bar is a widget whose saved text form is updated to the fit's end
(``progress_bar``). Spark's own console progress is off while a fit runs
(``console_progress_off``); a driver line the user must see is printed as the ranks' are
(``show_fit_line``).

The last lines of every rank are kept for error messages (``tail``). Reading is
best-effort: a store that fails for a moment delays lines, it never fails the fit.

Given ``cancel``, it also ends a job that outlives its recorded failure: once a rank has
written the launch's failure record (``record_failure``), Spark normally fails the
job within seconds (the failing task ends, Spark kills the others). Should a rank not end
(one that waits on a peer Spark never kills), ``cancel`` is called ``FAILED_JOB_GRACE_S``
after the record appeared, and the fit raises the recorded error. Given ``watch``, it
calls it every ``WATCH_S`` seconds while the job runs (an elastic fit asks its ranks to grow
from there, in ``driver.training_job``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import posixpath
import sys
import threading
import time
from collections.abc import Callable, Iterator

from tqdm.auto import tqdm

from ..shared.history import time_shares
from ..store import Store

POLL_S = 0.5
TAIL_LINES = 20
FAILED_JOB_GRACE_S = 30.0  # a failed launch's job still running after this is cancelled
WATCH_S = 2.0  # how often ``watch`` is called
logger = logging.getLogger("spark_estimator.worker")
log = logging.getLogger(__name__)
CONNECT_PROGRESS = "SPARK_CONNECT_PROGRESS_BAR_ENABLED"  # pyspark.sql.connect.shell reads it


def rank_lines(rank: int, lines) -> str:
    """``lines`` of ``rank``'s output as errors show them: ``[rank <r>] <line>`` each."""
    return "\n".join(f"[rank {rank}] {line}" for line in lines)


def show_line(rank: int, line: str, printed: bool) -> None:
    """Log one line of a rank's output on the driver (and print it, when ``printed``)."""
    logger.info("[rank %d] %s", rank, line)
    if printed:
        tqdm.write(f"[rank {rank}] {line}", file=sys.stderr)


def show_fit_line(log: logging.Logger, line: str, printed: bool) -> None:
    """Log one line of the driver's on ``log`` (INFO), and where ``printed`` and no logging
    is configured for ``log``, print it too (to stderr, above a progress bar), as the
    ranks' lines are: a line the user must see with Python's default logging."""
    log.info(line)
    if printed and not logging_configured(log):
        tqdm.write(line, file=sys.stderr)


def print_lines_by_default() -> bool:
    """Whether ranks' lines are also printed: no logging is configured for them."""
    return not logging_configured(logger)


def logging_configured(log: logging.Logger) -> bool:
    """Whether a handler (other than a NullHandler) would see ``log``'s records."""
    while log is not None:
        if any(not isinstance(h, logging.NullHandler) for h in log.handlers):
            return True
        log = log.parent if log.propagate else None
    return False


def progress_bar(total: int, done: int):
    """A fit's bar at ``done`` of ``total`` steps, and in Jupyter (where ``tqdm.auto`` is
    its widget) the display handle it is shown with, else None. Jupyter saves a widget's
    text form (what GitHub and other static viewers show) as it was when displayed: the
    handle updates it to the final state when the fit ends (``FitMonitor.__exit__``)."""
    kind = dict(total=total, initial=done, unit="step", dynamic_ncols=True)
    if not any(c.__module__ == "tqdm.notebook" for c in tqdm.__mro__):
        return tqdm(**kind), None
    from IPython.display import display  # there in Jupyter

    bar = tqdm(**kind, display=False)
    return bar, display(bar.container, display_id=True)


class _ConsoleProgress:
    """Spark's console progress bar taken off while fits of this process run (threads of
    a CrossValidator share it): the JVM's SparkContext it was taken from, or the Connect
    client's setting of it (the environment variable it reads), and how many fits run."""

    lock = threading.Lock()
    fits = 0
    taken = None  # ("jvm", (the JVM's SparkContext, the gateway)) | ("connect", former value)


@contextlib.contextmanager
def console_progress_off(spark) -> Iterator[None]:
    """Spark's console progress (``spark.ui.showConsoleProgress``: the ``[Stage N: ...]``
    bars the JVM draws on stderr, on by default in a Python program) off while the block
    runs, then as it was: its bars would be drawn over a fit's own progress bar and lines.
    A classic session's bar is stopped and a new one made after; on Spark Connect the
    client's bar (``SPARK_CONNECT_PROGRESS_BAR_ENABLED``) is off, as the server's is not
    drawn here. Best-effort: where Spark's internals differ, the bar stays."""
    with _ConsoleProgress.lock:
        if _ConsoleProgress.fits == 0:
            _ConsoleProgress.taken = _take_console_progress(spark)
        _ConsoleProgress.fits += 1
    try:
        yield
    finally:
        with _ConsoleProgress.lock:
            _ConsoleProgress.fits -= 1
            if _ConsoleProgress.fits == 0 and _ConsoleProgress.taken is not None:
                _give_console_progress_back(*_ConsoleProgress.taken)
                _ConsoleProgress.taken = None


def _progress_field(jsc):
    field = jsc.getClass().getDeclaredField("_progressBar")
    field.setAccessible(True)
    return field


def _take_console_progress(spark):
    if type(spark).__module__.startswith("pyspark.sql.connect"):
        former = os.environ.get(CONNECT_PROGRESS)
        os.environ[CONNECT_PROGRESS] = "0"
        return ("connect", former)
    try:
        jsc = spark.sparkContext._jsc.sc()
        bar = jsc.progressBar()
        if bar.isEmpty():
            return None
        jvm = spark.sparkContext._jvm
        _progress_field(jsc).set(jsc, jvm.scala.Option.empty())
        bar.get().stop()
        return ("jvm", (jsc, jvm))
    except Exception as e:
        log.debug("could not stop Spark's console progress: %s", e)
        return None


def _give_console_progress_back(kind: str, held) -> None:
    if kind == "connect":
        if held is None:
            os.environ.pop(CONNECT_PROGRESS, None)
        else:
            os.environ[CONNECT_PROGRESS] = held
        return
    jsc, jvm = held
    try:
        if not jsc.isStopped():
            bar = jvm.org.apache.spark.ui.ConsoleProgressBar(jsc)
            _progress_field(jsc).set(jsc, jvm.scala.Option.apply(bar))
    except Exception as e:
        log.debug("could not restore Spark's console progress: %s", e)


class FitMonitor:
    """Follows one launch of a run (a context manager around the training job)."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        launch_id: str,
        verbose: bool,
        show: Callable[[int, str, str], None] | None = None,
        cancel: Callable[[], None] | None = None,
        watch: Callable[[], None] | None = None,
    ):
        self.store, self.launch_id, self.verbose = store, launch_id, verbose
        self.cancel, self.failure_seen = cancel, None
        self.watch, self.watched = watch, 0.0
        self.run = store.run(run_id)
        self.seen: set[str] = set()
        self.tails: dict[int, collections.deque] = {}
        print_lines = verbose and print_lines_by_default()
        self.show = show or (lambda rank, stream, line: show_line(rank, line, print_lines))
        self.bar = self.shown = None
        self.stop = threading.Event()
        self.lock = threading.Lock()

    # -- reading --------------------------------------------------------------------------
    def poll(self) -> None:
        with self.lock:
            self._read_logs()
            if self.verbose:
                self._read_progress()

    def _read_logs(self) -> None:
        if not self.store.exists(self.run.logs):
            return
        chunks = []
        for path in self.store.fs.find(self.run.logs):
            name, rank = posixpath.basename(path), self.run.log_rank(path)
            if rank is not None and name.startswith(self.launch_id) and path not in self.seen:
                chunks.append((rank, name, path))
        for rank, name, path in sorted(chunks):
            text = self.store.read_bytes(path).decode(errors="replace")
            self.seen.add(path)
            tail = self.tails.setdefault(rank, collections.deque(maxlen=TAIL_LINES))
            stream = self.run.log_stream(name)
            for line in text.splitlines():
                tail.append(line)
                self.show(rank, stream, line)

    def _read_progress(self) -> None:
        if not self.store.exists(self.run.progress):
            return
        progress = self.store.read_json(self.run.progress)
        if progress.get("launch_id") != self.launch_id:
            return  # an earlier fit of the same run_id
        steps, epoch = progress["steps"], progress["epoch"]
        done = (epoch - 1) * steps + progress["step"]
        if self.bar is None:  # starts where training is: the steps before are not timed
            self.bar, self.shown = progress_bar(progress["epochs"] * steps, done)
        else:
            self.bar.update(done - self.bar.n)
        self.bar.set_description(f"epoch {epoch}/{progress['epochs']}", refresh=False)
        postfix = {"loss": progress["loss"]}
        last = progress.get("last") or {}
        if (last.get("validation") or {}).get("loss") is not None:
            postfix["val_loss"] = last["validation"]["loss"]
        postfix = {k: f"{v:.4g}" for k, v in postfix.items() if v is not None}
        shares = time_shares(last)  # where the last epoch's time went, over all ranks
        if shares:
            postfix.update({k[:4]: f"{v:.0%}" for k, v in shares.items()})
        self.bar.set_postfix(postfix)

    def _poll_loop(self) -> None:
        while not self.stop.wait(POLL_S):
            try:
                self.poll()
                self._end_a_failed_job()
                if self.watch is not None and time.monotonic() - self.watched >= WATCH_S:
                    self.watched = time.monotonic()
                    self.watch()
            except Exception as e:  # e.g. a file of the store not readable for a moment
                logger.debug("could not read the run's progress: %s", e)

    def _end_a_failed_job(self) -> None:
        if self.cancel is None:
            return
        if self.failure_seen is None:
            if self.store.exists(self.run.failure(self.launch_id)):
                self.failure_seen = time.monotonic()
        elif time.monotonic() - self.failure_seen >= FAILED_JOB_GRACE_S:
            log.warning(
                "a rank's failure was recorded %.0f s ago and the training job still runs: "
                "cancelling it",
                FAILED_JOB_GRACE_S,
            )
            cancel, self.cancel = self.cancel, None
            cancel()

    # -- context --------------------------------------------------------------------------
    def __enter__(self) -> FitMonitor:
        """Follow one launch; a fit started again re-enters the same monitor, so lines
        already shown are not shown again (``cancel`` and ``watch`` may change between)."""
        self.stop, self.failure_seen = threading.Event(), None
        self.thread = threading.Thread(target=self._poll_loop, name="fit-monitor", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        try:
            self.poll()  # what the ranks wrote last, a failing rank's lines included
        except Exception as e:
            logger.debug("could not read the run's progress: %s", e)
        if self.bar is not None:
            self.bar.close()
            if self.shown is not None:  # the notebook's saved text: the final state
                self.shown.update(self.bar.container)
            self.bar = self.shown = None

    def tail(self, rank: int | None = None) -> str:
        """The last lines of ``rank`` (of every rank when None), for error messages."""
        ranks = sorted(self.tails) if rank is None else [rank]
        return "\n".join(rank_lines(r, self.tails[r]) for r in ranks if self.tails.get(r))
