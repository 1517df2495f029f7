"""Executor: ``hvd.HorovodInternalError``, what a collective raises when a peer is gone.

Horovod raises it when a collective fails because another process failed or left, so that a
script may catch it (``hvd.elastic.run`` restores the last commit in the surviving
processes and goes on). Here torch.distributed reports such a failure as a gloo
``RuntimeError`` (a closed connection, a timeout), a ``DistError`` (NCCL, the TCPStore) or
the shared-memory allreduce's error (``shared/failures.is_peer_failure``): every public
collective of ``spark_estimator.horovod`` (``peer_errors``) raises those again as a
``HorovodInternalError``, chained to the original. It stays a peer failure for the task
(``PeerFailure``): the lost rank is the failure, and the job starts again; in a Spark
barrier job the survivors cannot go on without it (``hvd.elastic``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

from ..shared.failures import PeerFailure, is_peer_failure

F = TypeVar("F", bound=Callable)


class HorovodInternalError(PeerFailure):
    """Horovod's: a collective failed because another rank failed, died or hung."""


def peer_errors(fn: F) -> F:
    """``fn`` (a collective) raising ``HorovodInternalError`` for a peer's failure."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PeerFailure:
            raise
        except Exception as e:
            if is_peer_failure(e):
                raise HorovodInternalError(f"{type(e).__name__}: {e}") from e
            raise

    return wrapper  # type: ignore[return-value]
