"""Executor: where the ranks of a barrier job meet, and the job's key-value store they meet
in (rank 0's TCPStore, sealed under the launch's secret).

Rank 0 starts a TCPStore on an OS-chosen port (bound before anyone is told of it, so no
other process can take the port in between) and writes its host and port to the job's
``Meeting`` file in the store, which the other ranks poll (``meet``); the values the ranks
exchange through the TCPStore are sealed under the launch's secret (``sealed_store``): the
driver makes the secret for each launch, and it reaches the tasks only inside their closure
(Spark's channel), never the store nor the TCPStore, in a key or a value.
Spark's barrier ``allGather`` is not used: it checks for the others' messages once a
second, which kept every rank but the last waiting up to a second.

The same store counts the job's failures, so that the first failing rank's error is the
one Spark reports (``first_failure``), also where a stranger on the port tampered with the
count (``TAMPERED``).
"""

from __future__ import annotations

import posixpath
import socket
import time
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from ...store import RunFolder, Store
from .sealed_store import ForgedValue, SealedStore

_FAILURES_KEY = "failures"
TAMPERED = (
    "spark-estimator: rank {rank} found the job's failure count in rank 0's TCPStore "
    "tampered with: it held a value that no rank of this launch wrote (a process outside the "
    "job reached the port). The rank replaced it and counted the failures from there, so "
    "that the first failure is still the one recorded."
)
POLL_S = (0.005, 0.25)  # the first and the longest wait between reads of the meeting file
COUNTED_S = 2.0  # how long rank 0 keeps the store, after a failure, for the others to count


@dataclass(frozen=True)
class Meeting:
    """Where the ranks of a launch learn rank 0's TCPStore address, and the secret that
    seals the values they exchange through it (``sealed_store``). Rank 0 writes
    ``{"host", "port"}`` to ``run``'s address file of launch ``launch_id`` (in ``store``),
    named after the Spark stage, so each barrier job of a launch (an elastic fit starts
    several) has its own (the job is one result stage, which Spark never attempts twice),
    and removes it when the group ends or fails to form. ``secret`` is made afresh for each
    barrier job and travels only inside its tasks (with the job's spec), never in the store
    nor the TCPStore: a process that reads the store, or reaches the port, finds no address
    or id it could use, and its own writes to the port are refused."""

    store: Store
    run: RunFolder
    launch_id: str
    secret: str = field(repr=False)  # made on the driver (``shared.spec.launch_secret``)

    def address_file(self, ctx) -> str:
        """This barrier job's address file (``ctx``: its BarrierTaskContext)."""
        return self.run.meeting(self.launch_id, ctx.stageId())

    def remove_address(self, ctx) -> None:
        """Remove rank 0's address file: the group formed, or never will."""
        with suppress(OSError):
            self.store.remove(self.address_file(ctx))


def meet(ctx, meeting: Meeting, rank: int, world_size: int, host: str, timeout: timedelta):
    """The job's key-value store: (a store private to this job, rank 0's server or None,
    the server's port).

    Rank 0 starts a TCPStore server on an OS-chosen port and writes host and port to the
    job's address file (``Meeting``); the other ranks read it as soon as it is there and
    connect. Every rank then reads and writes the TCPStore sealed under the launch's secret
    (``SealedStore``): a stranger who connects to the port reads only sealed values and
    cannot feed a rank one of its own. The server lives as long as the group. (A script's
    own ``env://`` group knows no secret: it is torch's plain client of the same server.)
    """
    path = meeting.address_file(ctx)
    server = None
    if rank == 0:
        server = dist.TCPStore(
            host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        master = {"host": host, "port": server.port}
        meeting.store.write_json(path, master)
    else:
        master = _read_address(meeting.store, path, timeout)
    client = server or dist.TCPStore(
        master["host"], master["port"], world_size, is_master=False, timeout=timeout
    )
    store = SealedStore(dist.PrefixStore("spark-estimator/", client), meeting.secret)
    return store, server, master["port"]


def _read_address(store: Store, path: str, timeout: timedelta) -> dict:
    """Rank 0's address from ``path``, read as soon as it is written (rank 0 writes it
    atomically); TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout.total_seconds()
    wait, longest = POLL_S
    while True:
        store.fs.invalidate_cache(posixpath.dirname(path))  # a listing cached without it
        try:
            return store.read_json(path)
        except FileNotFoundError:
            pass
        if time.monotonic() >= deadline:
            raise TimeoutError(f"rank 0 wrote no address to {path}")
        time.sleep(wait)
        wait = min(2 * wait, longest)


def first_failure(store) -> tuple[bool, bool]:
    """Whether no other rank of the job has failed before this one, and whether a process
    outside the job had tampered with the job's failure count.

    When one rank raises, the others usually fail a moment later inside a collective
    ("connection closed by peer"), and Spark reports whichever task failure reaches it
    first. So the first rank to fail claims that in the job's TCPStore and raises at once;
    later ones wait ``rendezvous.LATER_FAILURE_DELAY_S`` first, by which time Spark has
    failed the job with the original error and kills them. A failing rank tells its peers
    only after it claimed: it leaves the group, and what ``rendezvous.at_leave`` registered,
    once past the claim.

    The count is sealed (``SealedStore.add``): one that a stranger on the port wrote (a
    count, to pass for a rank that failed first, or no number) raises ``ForgedValue``.
    Only ranks that failed write it, so the rank replaces it, atomically, and counts from
    there: the first to do so is the first failure and records it, saying it was tampered
    (``TAMPERED``).

    Rank 0 serves the store: leaving after a failure, it waits for the others to count
    theirs (``await_failures``). A rank that comes later finds its port closed and asks the
    store nothing: torch would log the failed call with its C++ frames to stderr, which
    Spark shows on the driver's console after the job's error.
    """
    if _served_nowhere(store):  # rank 0 left: a failure came first
        return False, False
    try:
        return store.add(_FAILURES_KEY, 1) == 1, False
    except ForgedValue:
        try:
            return store.add(_FAILURES_KEY, 1, replace_forged=True) == 1, True
        except Exception:  # the store went away meanwhile: a failure came first
            return False, True
    except Exception:  # the store went away with rank 0: a failure came first
        return False, False


def await_failures(store, world_size: int, timeout_s: float = COUNTED_S) -> None:
    """Rank 0, whose process serves the job's store, leaving after a failure (its group
    gone, so the others' collectives fail with it): wait until all ``world_size`` ranks
    have counted their failure (``first_failure``), at most ``timeout_s``, so that none
    finds the store gone meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if store.add(_FAILURES_KEY, 0) >= world_size:
                return
        except Exception:  # a count a stranger wrote: no telling who counted
            return
        time.sleep(0.02)


def _served_nowhere(store) -> bool:
    """Whether the port of the job's TCPStore (under ``store``: sealed, prefixed) refuses
    connections: its server, rank 0's, has stopped."""
    server = store.inner.underlying_store
    try:
        socket.create_connection((server.host, server.port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    except OSError:  # unreachable for now: the store's own call decides
        return False
    return False
