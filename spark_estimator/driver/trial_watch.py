"""Driver: answer a running trial's epoch reports (the tuner's side of ``shared.pruning``).

While a trial's fit runs, a thread looks every ``poll_s`` for rank 0's report of the next
epoch, passes its value to ``decide`` (which reports it to the Optuna trial and asks its
pruner) and writes the answer that rank 0 is waiting for. Epochs answered before (by an
earlier fit of a resumed trial) are skipped. A ``decide`` that fails (the study's storage
unreachable) answers "go on": pruning is an optimization, never a reason to fail a fit.
Once ``aborted()`` says so (the search was interrupted), every answer is "abort". Before
the next fit of the trial starts, the reports an earlier fit left with no answer (its
driver killed while rank 0 waited) or answered "abort" are removed with those answers:
that epoch was not checkpointed, so the next fit trains it again and reports it itself.
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

    def _remove_unanswered(self) -> None:
        """Remove the reports an earlier fit of this trial left unanswered or answered
        "abort", with those answers: epochs no fit goes on from."""
        if not self.store.exists(self.run.trial):
            return
        for path in self.store.fs.find(self.run.trial):
            name = posixpath.basename(path)
            if not name.startswith("epoch-"):
                continue
            epoch = int(name[len("epoch-") :].split(".")[0])
            answer = self.run.trial_answer(epoch)
            if self.store.exists(answer):
                if not self.store.read_json(answer).get("abort"):
                    continue
                self.store.remove(answer)
            self.store.remove(self.run.trial_report(epoch))

    def __enter__(self) -> TrialWatch:
        self._remove_unanswered()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
