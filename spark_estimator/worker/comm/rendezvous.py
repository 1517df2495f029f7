"""Executor: join the job's torch.distributed process group for a task, and leave it.

``process_group`` ties the task's pieces together: it pins the task's device (``device``),
meets the other ranks at rank 0's TCPStore (``meeting``), forms one process group (gloo on
CPU, NCCL on GPU) through it, on the interface gloo can reach across hosts (``network``),
and records where the task sits in the job (``ranks.RankInfo``, ``current_rank_info``).

Every wait for other ranks is bounded by ``timeout_s``. When the block ends normally every
rank waits for the others before leaving; when it raises, the first failing rank's error is
the one Spark reports (see ``meeting.first_failure``). The group and rank 0's server are
closed (and its address file removed) when the task ends, failed or not, because PySpark
reuses workers (after a failure, the server once the others have counted theirs:
``meeting.await_failures``); what ``at_leave`` registered is closed before the group goes.

A script run by ``run(script_path)`` forms the default group itself: the task exports
torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``ROLE_NAME``,
``TORCHELASTIC_RUN_ID``, ``MASTER_ADDR``, ``MASTER_PORT``; ``torchrun_env``) and
``TORCHELASTIC_USE_AGENT_STORE=True``, with which torch's ``env://`` rendezvous connects
every rank, rank 0 included, as a client to the TCPStore rank 0's task already serves,
instead of starting a server of its own. ``TORCHELASTIC_RUN_ID`` makes
``torch.distributed.is_torchelastic_launched()`` true, so Lightning takes its
``TorchElasticEnvironment``: the ranks from ``RANK``, the node from ``GROUP_RANK``.
``run`` numbers its ranks host by host (``ranks.ranks_by_host``; ``ranks_by_host``).
``init_default_group`` (``hvd.init()``) does the same for scripts that never call
``init_process_group``, and forms a group of one outside any task.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from ...shared.failures import is_retried
from ...shared.spec import COLLECTIVE_TIMEOUT_S
from ..environ import environ
from .device import task_device, task_gpu_addresses
from .meeting import TAMPERED, Meeting, await_failures, first_failure, meet
from .network import gloo_interface
from .ranks import RankInfo, cross_ranks, homogeneous, job_ranks, local_ranks, node_ranks

log = logging.getLogger(__name__)

LATER_FAILURE_DELAY_S = 3.0  # how long a rank that did not fail first waits before raising


_current: RankInfo | None = None
_script_timeout: timedelta | None = None  # set while a script's task leaves the group to it
_leaving: list[Callable[[], None]] = []  # at_leave's, run when the task leaves the group


def current_rank_info() -> RankInfo:
    """The RankInfo of the process group this task is in; RuntimeError outside of one."""
    if _current is None:
        raise RuntimeError(
            "not inside a spark-estimator task: call this from a function run by "
            "spark_estimator.run or from the training loop's hooks"
        )
    return _current


class RendezvousError(RuntimeError):
    """The job's process group could not be formed."""


@contextmanager
def process_group(
    ctx,
    meeting: Meeting,
    use_gpu: bool | str,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
    on_failure: Callable[[int, BaseException], None] | None = None,
    init_group: bool = True,
    on_error: Callable[[], None] | None = None,
    ranks_by_host: bool = False,
    run_id: str = "none",
) -> Iterator[RankInfo]:
    """Join the barrier job's process group for the duration of the ``with`` block; the
    ranks meet at ``meeting`` (see ``Meeting``).

    ``timeout_s`` bounds every wait for the other ranks: forming the group, and each
    collective (a rank that died or hangs makes the others raise after that long).
    ``on_failure(rank, error)`` is called, before the error propagates, for the job's
    first failure unless it is one that a retry may cure (see ``is_retried``), and for a
    rendezvous that cannot form. ``on_error()`` is called first whenever the block raises
    (the task writes its output lines then: leaving the group may take long, and Spark may
    kill the process meanwhile).

    With ``init_group=False`` (a script) the default group is not formed here: the block
    runs with torchrun's variables exported (see above), the ranks meet at its end through
    the job's store (the script may have destroyed its group), and a group the script left
    initialised is destroyed after it; ``run_id`` is its ``TORCHELASTIC_RUN_ID``.

    With ``ranks_by_host`` the ranks are numbered host by host, as torchrun's (see
    ``ranks``), not as Spark numbers the tasks; task 0 is rank 0 either way.
    """
    global _current, _script_timeout
    rank, hosts = job_ranks(ctx, ranks_by_host)
    world_size = len(hosts)
    try:
        device, note = task_device(ctx, use_gpu)
    except RuntimeError as e:  # use_gpu=True and no GPU here: the driver raises it
        if on_failure is not None:
            on_failure(rank, e)
        raise
    timeout = timedelta(seconds=timeout_s)
    network = gloo_interface(hosts, rank)
    began = time.monotonic()
    store = server = None
    try:
        store, server, port = meet(ctx, meeting, rank, world_size, hosts[0], timeout)
        if init_group:
            with environ(network):
                dist.init_process_group(
                    _backend(device), store=store, rank=rank, world_size=world_size, timeout=timeout
                )
    except Exception as e:
        error = RendezvousError(
            f"rendezvous: rank {rank} of {world_size} could not form the process group: it "
            f"failed after {time.monotonic() - began:.0f} s (collective_timeout="
            f"{timeout_s:g} s) with {type(e).__name__}: {e}. Every task must reach the store, "
            f"the TCP port rank 0 opened on {hosts[0]}, and every other rank's host; check "
            "firewalls, GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, and that all executors can "
            "run at once."
        )
        if on_failure is not None:
            on_failure(rank, error)
        if server is not None:  # rank 0 formed no group: nobody may still read its address
            meeting.remove_address(ctx)
        # nor kept listening by the frames of the error's traceback (torch's, which hold the
        # store, and this one)
        traceback.clear_frames(e.__traceback__)
        del store, server
        raise error from e
    node, nodes = node_ranks(hosts, rank)
    _current = RankInfo(
        rank,
        world_size,
        *local_ranks(hosts, rank),
        device,
        note,
        *cross_ranks(hosts, rank),
        tuple(task_gpu_addresses(ctx.resources())),
        homogeneous=homogeneous(hosts),
        node_rank=node,
        num_nodes=nodes,
    )
    torchrun = {} if init_group else torchrun_env(_current, hosts[0], port, run_id)
    _script_timeout = None if init_group else timeout
    failed = False
    try:
        with environ({**network, **torchrun}):
            yield _current
        # nobody leaves while another rank still works: a gloo peer that closes its
        # connections early fails the others' collectives (and their setup)
        if init_group:
            dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
        else:
            _leave_together(store, rank, world_size, timeout)
    except BaseException as e:  # sys.exit() in the code too
        failed = True
        if on_error is not None:
            on_error()
        first, tampered = first_failure(store)
        if tampered:
            log.warning(TAMPERED.format(rank=rank))
            if hasattr(e, "add_note"):  # Python 3.11+: in the record and in Spark's error
                e.add_note(TAMPERED.format(rank=rank))
        if first and on_failure is not None and not is_retried(e):
            on_failure(rank, e)
        if not first:
            log.warning(
                "rank %d failed (%s) after another rank did; raising in %.0f s",
                rank,
                type(e).__name__,
                LATER_FAILURE_DELAY_S,
            )
            time.sleep(LATER_FAILURE_DELAY_S)
        raise
    finally:
        _current, _script_timeout = None, None
        while _leaving:
            _leaving.pop()()
        if dist.is_initialized():
            dist.destroy_process_group()
        if server is not None:  # its address is of no use to anyone any more
            meeting.remove_address(ctx)
            if failed:  # the others, failing with the group, count in its store
                await_failures(store, world_size)
        del store, server  # rank 0's TCPStore stops listening when released
        if device.type == "cuda":
            torch.cuda.empty_cache()


def torchrun_env(info: RankInfo, master: str, port: int, run_id: str) -> dict[str, str]:
    """The variables torchrun gives each worker, for the rank ``info`` of a job whose
    rank 0 serves its TCPStore at ``master``:``port``: one role ("default") of every rank,
    one node per host, ``run_id`` as the rendezvous id; ``TORCHELASTIC_USE_AGENT_STORE``
    has torch's ``env://`` rendezvous join that store as a client."""
    return {
        "RANK": str(info.rank),
        "WORLD_SIZE": str(info.world_size),
        "LOCAL_RANK": str(info.local_rank),
        "LOCAL_WORLD_SIZE": str(info.local_size),
        "GROUP_RANK": str(info.node_rank),
        "GROUP_WORLD_SIZE": str(info.num_nodes),
        "ROLE_RANK": str(info.rank),
        "ROLE_WORLD_SIZE": str(info.world_size),
        "ROLE_NAME": "default",
        "TORCHELASTIC_RUN_ID": run_id,
        "MASTER_ADDR": master,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": str(True),
    }


def at_leave(close: Callable[[], None]) -> None:
    """Call ``close`` when this task leaves the job's process group (``process_group``):
    after a failing rank has claimed and recorded its failure, before the group goes, so
    peers waiting on what ``close`` releases (the shared-memory allreduce) fail later."""
    _leaving.append(close)


def _leave_together(store, rank: int, world_size: int, timeout: timedelta) -> None:
    """Wait, through the store, until every rank has finished its script. Rank 0, whose
    process serves the store, waits too until every other rank is done waiting: a server
    that stops while a rank still waits on it fails that rank ("Failed to recv")."""
    store.set(f"left/{rank}", "1")
    store.wait([f"left/{r}" for r in range(world_size)], timeout)
    if rank == 0:
        store.wait([f"gone/{r}" for r in range(1, world_size)], timeout)
    else:
        store.set(f"gone/{rank}", "1")


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_default_group() -> None:
    """Form torch.distributed's default group for code that asks for one (``hvd.init()``),
    when it is not formed yet.

    In the task of a script run by ``run`` it is the job's group, formed from torchrun's
    variables (``env://``), on the device the task pinned, with ``collective_timeout``.
    Outside any Spark task it is a group of one process (rank 0 of 1) on ``cuda:0`` when
    there is a GPU, else on the CPU, so that a script run with plain
    ``python`` runs as a job of size 1.
    """
    global _current
    if dist.is_initialized():
        return
    if _current is None:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(_backend(device), store=dist.HashStore(), rank=0, world_size=1)
        _current = RankInfo(0, 1, 0, 1, device)
    elif _script_timeout is not None:
        dist.init_process_group(
            _backend(_current.device), init_method="env://", timeout=_script_timeout
        )
    else:
        raise RuntimeError(
            "the job's process group was destroyed inside a function run by "
            "spark_estimator.run; it cannot be formed again there"
        )
