"""Which training failures are retried and how the others reach the driver.

The driver starts a fit's barrier job again when one of its tasks fails
(``driver.elastic``): that is how training survives a lost process or executor, resuming
from the last checkpoint. It must not retry an exception raised by the training code (a
bug or bad data raises again, every attempt). So the first rank to raise such an exception
writes it, with its traceback, to the run's ``failures/<launch_id>.json`` in the store
before its task fails, and the driver, finding the record, raises it as a
``TrainingError`` instead.

Two kinds of exception are retried (not recorded), and the retry resumes:
- those that only say a peer went away (gloo's "connection reset" or "timed out", the
  shared-memory allreduce's ``SHM_TAG`` errors, torch.distributed's ``DistError``, or
  ``PeerFailure``: ``hvd.HorovodInternalError``, which carries any of these):
  the rank that died is the failure;
- I/O errors (``OSError``: a store or a network that failed for a moment). One that
  persists fails every attempt, and the driver's error after the last one
  (``max_restarts``) chains Spark's, which carries it.

``run(fn)`` records the same failure in its run's folder; a run is started again after a
failure without a record only when its ranks entered ``hvd.elastic.run``. Its failing rank
also carries the record, with its last lines of output, in a note of its exception
(``carry_failure``): Spark's error on the driver shows the note within the remote
traceback, and the driver reads the record back from it (``carried_failure``) where it
cannot read the store (a multi-host cluster given no shared store).

Used on both sides: executors write records, the driver reads them.
"""

from __future__ import annotations

import json
import traceback

import torch.distributed as dist

from ..store import Store

# the tag of the errors of a peer that died or hung during a shared-memory gradient
# allreduce (SharedMemoryAllreduce), which stands in for gloo's on one host
SHM_TAG = "shm-allreduce/"
_CARRIED = "spark-estimator failure record: "  # starts the note of carry_failure


class TrainingError(RuntimeError):
    """The training code (a fit's, or ``run``'s ``fn``) raised on a rank.

    The first failing rank's exception, with its type, message and traceback. Retrying
    would only raise it again, so the run stops. A fit's checkpoints stay in the store, and
    a new fit with the same ``run_id`` resumes from them once the cause is fixed. For
    ``run(fn)`` it is the run's folder in its store.

    It is raised ``from None``: Spark's error of the failed job (its Java stack and the
    executor's copy of the traceback) would show the same failure again. ``spark_error``
    keeps it (None where the error did not come from a Spark job).
    """

    spark_error: BaseException | None = None

    def __init__(self, run_id: str | None, record: dict, output: str = ""):
        self.run_id = run_id
        self.rank = record["rank"]
        self.remote_type = record["type"]
        self.remote_message = record["message"]
        self.remote_traceback = record["traceback"]
        self.output = output  # the rank's last lines of output and logging
        shown = f"(last output of rank {self.rank}:)\n{output}\n" if output else ""
        where = f"rank {self.rank}" + (f" of run '{run_id}'" if run_id is not None else "")
        super().__init__(
            f"{self.remote_type}: {self.remote_message}\n{shown}"
            f"(raised on {where}; remote traceback:)\n{self.remote_traceback}"
        )


class PeerFailure(RuntimeError):
    """A collective failed because another rank failed, died or hung (``hvd``'s
    ``HorovodInternalError`` is one)."""


def is_retried(error: BaseException) -> bool:
    """Whether the training job should be started again after ``error`` (see above)."""
    return is_peer_failure(error) or isinstance(error, OSError)


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` only reports that another rank failed, died or hung."""
    if isinstance(error, (dist.DistError, PeerFailure)):
        return True
    # gloo raises plain RuntimeErrors tagged with its source path; the shared-memory
    # allreduce tags its own, which reach here through DDP as RuntimeErrors too
    text = str(error)
    return isinstance(error, RuntimeError) and ("gloo/" in text or SHM_TAG in text)


def failure_record(rank: int, error: BaseException) -> dict:
    """What a ``TrainingError`` needs of ``error``, raised on ``rank``: JSON values."""
    exited = isinstance(error, SystemExit)
    return {
        "rank": rank,
        "type": type(error).__name__,
        "message": f"sys.exit({error.code!r})" if exited else str(error),
        "traceback": "".join(traceback.format_exception(error)),
    }


def record_failure(path: str, store: Store, rank: int, error: BaseException) -> None:
    """Write ``error`` as the failure of this launch (atomically, so never half-read)."""
    store.write_json(path, failure_record(rank, error))


def read_failure(path: str, store: Store) -> dict | None:
    return store.read_json(path) if store.exists(path) else None


def carry_failure(error: BaseException, rank: int, output: list[str]) -> None:
    """Add ``error``'s record, with the rank's last lines of ``output``, to its notes: one
    line of JSON after ``_CARRIED``, which Spark's error shows on the driver."""
    record = {**failure_record(rank, error), "output": output}
    error.add_note(_CARRIED + json.dumps(record))


def carried_failure(error: BaseException) -> dict | None:
    """The record a failing rank carried in ``error`` (Spark's error), or None."""
    text = str(error)
    start = text.find(_CARRIED)
    if start < 0:
        return None
    try:
        return json.loads(text[start + len(_CARRIED) :].split("\n", 1)[0])
    except ValueError:  # cut short on its way (a truncated message)
        return None
