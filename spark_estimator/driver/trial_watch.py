"""Driver: answer a running trial's epoch reports (the tuner's side of ``shared.pruning``).

While a trial's fit runs, a thread looks every ``poll_s`` for rank 0's report of the next
epoch, passes its value to ``decide`` (which reports it to the Optuna trial and asks its
pruner) and writes the answer that rank 0 is waiting for. Epochs answered before (by an
earlier fit of a resumed trial) are skipped. A ``decide`` that fails (the study's storage
unreachable) answers "go on": pruning is an optimization, never a reason to fail a fit.
Once ``aborted()`` says so (the search was interrupted), every answer is "abort", and the
"abort" answers an earlier fit of the trial left are removed before its next fit starts.
"""

from __future__ import annotations

import logging
import posixpath
import threading
from collections.abc import Callable

from ..shared.pruning import poll_s
from ..store import Store

log = logging.getLogger(__name__)


class TrialWatch:
    """Answers one run's epoch reports while the block runs (a context manager)."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        decide: Callable[[int, float], bool],
        aborted: Callable[[], bool] = lambda: False,
    ):
        self.store, self.run = store, store.run(run_id)
        self.decide, self.aborted = decide, aborted
        self.next_epoch = 1
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=f"trial-{run_id}", daemon=True)

    def _loop(self) -> None:
        every = poll_s(self.store)
        while not self.stop.is_set():
            try:
                if not self._answer_next():
                    self.stop.wait(every)
            except Exception as e:  # a store that fails for a moment: look again
                log.debug("tuning: could not read run %s's report: %s", self.run.path, e)
                self.stop.wait(every)

    def _answer_next(self) -> bool:
        """Answer the next epoch's report when it is there; whether there was one to take."""
        epoch = self.next_epoch
        answer = self.run.trial_answer(epoch)
        if self.store.exists(answer):  # answered by an earlier fit of this trial
            self.next_epoch += 1
            return True
        report = self.run.trial_report(epoch)
        if not self.store.exists(report):
            return False
        value = float(self.store.read_json(report)["value"])
        prune = False
        if not self.aborted():
            try:
                prune = bool(self.decide(epoch, value))
            except Exception as e:
                log.warning("tuning: could not report epoch %d to the trial (%s)", epoch, e)
        if self.aborted():
            self.store.write_json(answer, {"prune": True, "abort": True})
            return False  # no next epoch: the same answer for a report of this epoch again
        self.store.write_json(answer, {"prune": prune})
        self.next_epoch += 1
        return True

    def _remove_aborts(self) -> None:
        """Remove the "abort" answers an interrupted fit of this trial left."""
        if not self.store.exists(self.run.trial):
            return
        for path in self.store.fs.find(self.run.trial):
            if posixpath.basename(path).startswith("answer-"):
                if self.store.read_json(path).get("abort"):
                    self.store.remove(path)

    def __enter__(self) -> TrialWatch:
        self._remove_aborts()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
