"""Executor: pin the device Spark assigned, join the job's torch.distributed process group.

Rank 0 starts a TCPStore on an OS-chosen port (bound before anyone is told of it, so no
other process can take the port in between) and writes its host and port to the job's
``Meeting`` file in the store, which the other ranks poll; every rank then joins one process
group (gloo on CPU, NCCL on GPU) through that TCPStore, whose values are sealed under the
launch's secret (``sealed_store``): the driver makes the secret for each launch, and it
reaches the tasks only inside their closure (Spark's channel), never the store nor the
TCPStore, in a key or a value.
Spark's barrier ``allGather`` is not used: it checks for the others' messages once a
second, which kept every rank but the last waiting up to a second.

Every wait for other ranks is bounded by ``timeout_s``. When the block ends normally every
rank waits for the others before leaving; when it raises, the first failing rank's error is
the one Spark reports (see ``_first_failure``). The group and rank 0's server are closed
(and its address file removed) when the task ends, failed or not, because PySpark reuses
workers.

A script run by ``run("train.py")`` forms the default group itself: the task exports
torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) and ``TORCHELASTIC_USE_AGENT_STORE=True``, with which
torch's ``env://`` rendezvous connects every rank, rank 0 included, as a client to the
TCPStore rank 0's task already serves, instead of starting a server of its own.
``init_default_group`` (``hvd.init()``) does the same for scripts that never call
``init_process_group``, and forms a group of one outside any task.

Gloo finds its own address by resolving the machine's host name; where that resolves to a
loopback address (an ``/etc/hosts`` that maps the name to 127.0.x.1) no rank on another
host can reach it. So when the ranks span several hosts and the user set no
``GLOO_SOCKET_IFNAME``, the task sets it, for the length of the group, to the interface
that carries its own address in the barrier context (``gloo_interface``).
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import posixpath
import socket
import struct
import subprocess
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ...shared.failures import is_retried
from ...shared.spec import COLLECTIVE_TIMEOUT_S
from ...store import RunFolder, Store
from ..environ import environ
from .sealed_store import ForgedValue, SealedStore

log = logging.getLogger(__name__)

LATER_FAILURE_DELAY_S = 3.0
_FAILURES_KEY = "failures"
_TAMPERED = (
    "spark-estimator: rank {rank} found the job's failure count in rank 0's TCPStore "
    "tampered with: it held a value that no rank of this launch wrote (a process outside the "
    "job reached the port). The rank replaced it and counted the failures from there, so "
    "that the first failure is still the one recorded."
)
POLL_S = (0.005, 0.25)  # the first and the longest wait between reads of the meeting file


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


@dataclass(frozen=True)
class RankInfo:
    """Where this task sits in the job: its ranks, the device it pinned, and, when it fell
    back to CPU although ``use_gpu`` asked for a GPU, why (``device_note``); the GPU
    addresses Spark assigned the task (``gpu_addresses``: also where it fell back)."""

    rank: int
    world_size: int
    local_rank: int  # rank among the job's tasks on this host
    local_size: int
    device: torch.device
    device_note: str | None = None
    cross_rank: int = 0  # rank among the job's tasks with this local rank (hvd.cross_rank)
    cross_size: int = 1
    gpu_addresses: tuple[str, ...] = ()  # TaskContext.resources()["gpu"].addresses
    homogeneous: bool = True  # every host runs as many of the job's ranks (hvd.is_homogeneous)


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


def local_ranks(hosts: Sequence[str], rank: int) -> tuple[int, int]:
    """(local rank, local size) of ``rank`` given the host of every rank."""
    same = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    return same.index(rank), len(same)


def cross_ranks(hosts: Sequence[str], rank: int) -> tuple[int, int]:
    """(cross rank, cross size) of ``rank`` given the host of every rank: its place among
    the ranks with the same local rank (Horovod's cross communicator; one rank per host)."""
    mine = local_ranks(hosts, rank)[0]
    same = [r for r in range(len(hosts)) if local_ranks(hosts, r)[0] == mine]
    return same.index(rank), len(same)


def homogeneous(hosts: Sequence[str]) -> bool:
    """Whether every host runs as many of the ranks (``hosts``: the host of every rank)."""
    return len(set(Counter(hosts).values())) == 1


def cuda_ordinal(address: str, visible_devices: str | None) -> int:
    """The torch device index of the GPU Spark calls ``address``.

    Spark's addresses are the ids its discovery script printed (physical ids). Where
    ``CUDA_VISIBLE_DEVICES`` restricts the process, torch numbers only the visible GPUs,
    so a listed id maps to its position in that list.
    """
    if visible_devices:
        visible = [v.strip() for v in visible_devices.split(",")]
        if address in visible:
            return visible.index(address)
    return int(address)


def select_device(
    use_gpu: bool | str,
    gpu_addresses: Sequence[str],
    cuda_available: bool,
    visible_devices: str | None = None,
) -> tuple[torch.device, str | None]:
    """The device for this task and, when falling back to CPU, the reason why.

    ``use_gpu`` is what the driver told the tasks (``driver.validate.tasks_use_gpu``):
    False, the CPU; ``"auto"`` (the cluster has GPUs configured), the GPU Spark assigned,
    else the CPU with a reason; True, that GPU or a RuntimeError naming ``use_gpu``.
    ``gpu_addresses`` are the GPU addresses Spark assigned to the task
    (``TaskContext.resources()["gpu"].addresses``); the first one is used.
    """
    if not use_gpu:
        return torch.device("cpu"), None
    if not gpu_addresses:
        if use_gpu is True:
            raise RuntimeError(
                "use_gpu: True requires a GPU for every task, but Spark assigned no GPU to "
                "this task (set spark.task.resource.gpu.amount)"
            )
        return torch.device("cpu"), (
            "GPUs are configured but this task got none (set spark.task.resource.gpu.amount "
            "to give each task one); training on CPU"
        )
    if not cuda_available:
        if use_gpu is True:
            raise RuntimeError(
                f"use_gpu: True and Spark assigned GPU {gpu_addresses[0]}, but torch has no "
                "CUDA support here (a CPU-only torch?)"
            )
        return torch.device("cpu"), (
            f"Spark assigned GPU {gpu_addresses[0]}, but torch has no CUDA support here; "
            "training on CPU"
        )
    return torch.device("cuda", cuda_ordinal(gpu_addresses[0], visible_devices)), None


def task_gpu_addresses(resources: Mapping) -> list[str]:
    gpu = resources.get("gpu")
    return list(gpu.addresses) if gpu is not None else []


def task_device(ctx, use_gpu: bool | str, warn: bool = True) -> tuple[torch.device, str | None]:
    """Pin the device for the running Spark task ``ctx`` and size torch's threads; return
    the device and, on a CPU fallback, the reason (the driver turns it into one warning).

    With ``warn`` the reason is also written to the executor's own log (its stderr),
    bypassing the capture of the rank's output (``run_log``): every rank would repeat it
    there, and it would open every ``TrainingError`` of a CPU cluster."""
    device, reason = select_device(
        use_gpu,
        task_gpu_addresses(ctx.resources()),
        torch.cuda.is_available(),
        os.environ.get("CUDA_VISIBLE_DEVICES"),
    )
    if reason and warn:
        print(f"spark-estimator task {ctx.partitionId()}: {reason}", file=sys.__stderr__)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, ctx.cpus()))
    return device, reason


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
) -> Iterator[RankInfo]:
    """Join the barrier job's process group for the duration of the ``with`` block; the
    ranks meet at ``meeting`` (see ``Meeting``).

    ``timeout_s`` bounds every wait for the other ranks: forming the group, and each
    collective (a rank that died or hangs makes the others raise after that long).
    ``on_failure(rank, error)`` is called, before the error propagates, for the job's
    first failure unless it is one that a retry may cure (see ``shared/failures.py``), and for a
    rendezvous that cannot form. ``on_error()`` is called first whenever the block raises
    (the task writes its output lines then: leaving the group may take long, and Spark may
    kill the process meanwhile).

    With ``init_group=False`` (a script) the default group is not formed here: the block
    runs with torchrun's variables exported (see above), the ranks meet at its end through
    the job's store (the script may have destroyed its group), and a group the script left
    initialised is destroyed after it.
    """
    global _current, _script_timeout
    infos = ctx.getTaskInfos()
    rank, world_size = ctx.partitionId(), len(infos)
    try:
        device, note = task_device(ctx, use_gpu)
    except RuntimeError as e:  # use_gpu=True and no GPU here: the driver raises it
        if on_failure is not None:
            on_failure(rank, e)
        raise
    hosts = [info.address.rsplit(":", 1)[0] for info in infos]
    timeout = timedelta(seconds=timeout_s)
    network = gloo_interface(hosts, rank)
    began = time.monotonic()
    store = server = None
    try:
        store, server, port = _rendezvous(ctx, meeting, rank, world_size, hosts[0], timeout)
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
            _close_meeting(meeting, ctx)
        # nor kept listening by the frames of the error's traceback (torch's, which hold the
        # store, and this one)
        traceback.clear_frames(e.__traceback__)
        del store, server
        raise error from e
    _current = RankInfo(
        rank,
        world_size,
        *local_ranks(hosts, rank),
        device,
        note,
        *cross_ranks(hosts, rank),
        tuple(task_gpu_addresses(ctx.resources())),
        homogeneous=homogeneous(hosts),
    )
    torchrun = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(_current.local_rank),
        "LOCAL_WORLD_SIZE": str(_current.local_size),
        "MASTER_ADDR": hosts[0],
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": str(True),
    }
    _script_timeout = None if init_group else timeout
    try:
        with environ({**network, **({} if init_group else torchrun)}):
            yield _current
        # nobody leaves while another rank still works: a gloo peer that closes its
        # connections early fails the others' collectives (and their setup)
        if init_group:
            dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
        else:
            _leave_together(store, rank, world_size, timeout)
    except BaseException as e:  # sys.exit() in the code too
        if on_error is not None:
            on_error()
        first, tampered = _first_failure(store)
        if tampered:
            log.warning(_TAMPERED.format(rank=rank))
            if hasattr(e, "add_note"):  # Python 3.11+: in the record and in Spark's error
                e.add_note(_TAMPERED.format(rank=rank))
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
            _close_meeting(meeting, ctx)
        del store, server  # rank 0's TCPStore stops listening when released
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _close_meeting(meeting: Meeting, ctx) -> None:
    """Remove rank 0's address file (``Meeting``): the group formed, or never will."""
    with suppress(OSError):
        meeting.store.remove(meeting.address_file(ctx))


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


def gloo_interface(hosts: Sequence[str], rank: int) -> dict[str, str]:
    """``{"GLOO_SOCKET_IFNAME": name}`` for a group whose ranks span several hosts: the
    interface that carries ``hosts[rank]`` (this task's address in the barrier context);
    empty when the user chose one, the ranks share one host, the address is a loopback
    one, or no interface here carries it."""
    if "GLOO_SOCKET_IFNAME" in os.environ or len(set(hosts)) < 2:
        return {}
    try:
        address = ipaddress.ip_address(socket.gethostbyname(hosts[rank]))
    except (OSError, ValueError):
        return {}
    name = None if address.is_loopback else interface_of(str(address))
    log.debug("rank %d: gloo interface for %s: %s", rank, address, name)
    return {"GLOO_SOCKET_IFNAME": name} if name else {}


_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's (first) IPv4 address


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that carries the IPv4 ``address``, or
    None: each interface's address by ioctl, then ``ip -o addr`` for secondary ones."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    try:
        lines = subprocess.run(
            ["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=10
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    for line in lines:  # "2: eth0    inet 10.0.0.2/24 brd ... scope global eth0"
        fields = line.split()
        if len(fields) > 3 and fields[3].split("/")[0] == address:
            return fields[1]
    return None


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_default_group() -> None:
    """Form torch.distributed's default group for code that asks for one (``hvd.init()``),
    when it is not formed yet.

    In the task of a script run by ``run`` it is the job's group, formed from torchrun's
    variables (``env://``), on the device the task pinned, with ``collective_timeout``.
    Outside any Spark task it is a group of one process (rank 0 of 1) on ``cuda:0`` when
    there is a GPU, else on the CPU, so that ``python train.py`` runs as a job of size 1.
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


def _rendezvous(ctx, meeting: Meeting, rank: int, world_size: int, host: str, timeout: timedelta):
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


def _first_failure(store) -> tuple[bool, bool]:
    """Whether no other rank of the job has failed before this one, and whether a process
    outside the job had tampered with the job's failure count.

    When one rank raises, the others usually fail a moment later inside a collective
    ("connection closed by peer"), and Spark reports whichever task failure reaches it
    first. So the first rank to fail claims that in the job's TCPStore and raises at once;
    later ones wait ``LATER_FAILURE_DELAY_S`` first, by which time Spark has failed the job
    with the original error and kills them. A failing rank tells its peers only after it
    claimed: it leaves the group, and what ``at_leave`` registered, once past the claim.

    The count is sealed (``SealedStore.add``): one that a stranger on the port wrote (a
    count, to pass for a rank that failed first, or no number) raises ``ForgedValue``.
    Only ranks that failed write it, so the rank replaces it, atomically, and counts from
    there: the first to do so is the first failure and records it, saying it was tampered.
    """
    try:
        return store.add(_FAILURES_KEY, 1) == 1, False
    except ForgedValue:
        try:
            return store.add(_FAILURES_KEY, 1, replace_forged=True) == 1, True
        except Exception:  # the store went away meanwhile: a failure came first
            return False, True
    except Exception:  # the store went away with rank 0: a failure came first
        return False, False
