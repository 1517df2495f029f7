"""Fault injection for the reliability tests: a callback that breaks one rank on purpose.

``Fault(action, rank, epoch, marker)`` acts on ``rank`` during ``epoch``, after that
rank's ``after_batches``-th training forward pass of the epoch:

- ``"kill"``: SIGKILL its own process (a crash: nothing is raised, nothing cleaned up);
- ``"kill-executor"``: SIGKILL the executor JVM running it (an executor lost; only on a
  cluster master such as local-cluster, where executors are processes of their own);
- ``"kill-worker"``: SIGKILL the standalone Worker JVM that started that executor, then
  the executor: its slot is lost for good (tests/clusters.py's clusters);
- ``"raise"``: raise ``ValueError("injected fault ...")`` from the training code;
- ``"io-error"``: raise ``OSError("injected I/O error ...")``, as a store that failed;
- ``"hang"``: sleep for an hour, as a rank stuck outside any collective.

With ``once`` the fault happens only while the file ``marker`` does not exist, and creates
it first, so the attempt Spark retries (or a later fit) trains normally. Executors of
local and local-cluster masters share this machine's filesystem, so the file is seen by all.
"""

from __future__ import annotations

import os
import signal
import time

from spark_estimator.callbacks import Callback

ACTIONS = ("kill", "kill-executor", "kill-worker", "raise", "io-error", "hang")


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def executor_jvm_pid() -> int:
    """The pid of the executor JVM above this Python worker (through PySpark's daemon)."""
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"CoarseGrainedExecutorBackend" in f.read():
                return pid
        pid = parent_pid(pid)
    raise RuntimeError("no executor JVM above this process (not a cluster master?)")


class Fault(Callback):
    def __init__(self, action, rank, epoch, marker, after_batches=2, once=True):
        assert action in ACTIONS
        self.action, self.rank, self.epoch, self.marker = action, rank, epoch, str(marker)
        self.after_batches, self.once = after_batches, once

    def on_epoch_begin(self, epoch, state):
        if state.rank != self.rank or epoch != self.epoch:
            return
        if self.once and os.path.exists(self.marker):
            return
        seen = []

        def hook(module, args, output):
            if module.training:
                seen.append(1)
                if len(seen) == self.after_batches:
                    self.fire(epoch)

        self.handle = state.model.register_forward_hook(hook)

    def on_epoch_end(self, epoch, logs, state):
        if getattr(self, "handle", None) is not None:
            self.handle.remove()
            self.handle = None

    def fire(self, epoch):
        if self.once:
            with open(self.marker, "w") as f:
                f.write(f"{self.action} rank {self.rank} epoch {epoch} pid {os.getpid()}\n")
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action == "kill-executor":
            os.kill(executor_jvm_pid(), signal.SIGKILL)
            time.sleep(3600)  # this worker goes down with its executor
        if self.action == "kill-worker":
            executor = executor_jvm_pid()
            with open(f"/proc/{parent_pid(executor)}/cmdline", "rb") as f:
                assert b"deploy.worker.Worker" in f.read(), "not on a standalone Worker"
            os.kill(parent_pid(executor), signal.SIGKILL)
            os.kill(executor, signal.SIGKILL)
            time.sleep(3600)
        if self.action == "hang":
            time.sleep(3600)
        if self.action == "io-error":
            raise OSError(f"injected I/O error on rank {self.rank} at epoch {epoch}")
        raise ValueError(f"injected fault on rank {self.rank} at epoch {epoch}")

    def state_dict(self):
        return {}
