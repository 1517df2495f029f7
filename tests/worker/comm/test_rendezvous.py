import contextlib
import json
import multiprocessing
import os
import re
import socket
import threading
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from spark_estimator.shared.failures import record_failure
from spark_estimator.store import Store
from spark_estimator.worker.comm import rendezvous
from spark_estimator.worker.comm.meeting import _FAILURES_KEY, Meeting
from spark_estimator.worker.comm.rendezvous import (
    LATER_FAILURE_DELAY_S,
    RendezvousError,
    current_rank_info,
    process_group,
)
from tests.worker.comm.test_device import FakeResource


def test_no_rank_info_outside_a_task():
    with pytest.raises(RuntimeError, match="not inside a spark-estimator task"):
        current_rank_info()


class FakeTaskInfo:
    def __init__(self, address):
        self.address = address


class FakeBarrierContext:
    """The parts of BarrierTaskContext that process_group uses, for one process."""

    def __init__(self, rank, world_size, gpus=(), hosts=None):
        self.rank, self.world_size, self.gpus = rank, world_size, list(gpus)
        self.hosts = hosts or ["127.0.0.1"] * world_size  # the host of each task

    def getTaskInfos(self):
        return [FakeTaskInfo(f"{host}:7077") for host in self.hosts]

    def partitionId(self):
        return self.rank

    def stageId(self):
        return 3

    def resources(self):
        return {"gpu": FakeResource(self.gpus)} if self.gpus else {}

    def cpus(self):
        return 1

    def allGather(self, message):  # Spark's: answers once a second; the ranks must not use it
        raise AssertionError("process_group used the barrier's allGather")


def meeting_in(folder) -> Meeting:
    """A launch's meeting place in a local store at ``folder``."""
    store = Store(str(folder))
    return Meeting(store, store.run("run-1"), "launch-1", "3a7d1f09c4e2b8656d0e9a1f7c3b5e28")


def secret_forms(secret: str) -> list[bytes]:
    """The launch's secret as the ranks hold it (hex text) and as the bytes it stands for."""
    return [secret.encode(), bytes.fromhex(secret)]


def test_the_rendezvous_port_is_closed_and_its_address_removed_afterwards(tmp_path):
    ctx, meeting = FakeBarrierContext(0, 1), meeting_in(tmp_path)
    with process_group(ctx, meeting, use_gpu=False, timeout_s=5) as info:
        assert info.rank == 0 and dist.is_initialized()
        written = meeting.store.read_bytes(meeting.address_file(ctx))
        assert not [f for f in secret_forms(meeting.secret) if f in written]  # where, not how
        address = json.loads(written)
        assert address["host"] == "127.0.0.1"
    assert not dist.is_initialized()
    assert not meeting.store.exists(meeting.address_file(ctx))  # removed with the group
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", address["port"]), timeout=2).close()


def test_the_rank_records_the_gpu_address_spark_assigned_also_on_a_cpu_fallback(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ctx = FakeBarrierContext(0, 1, gpus=["3"])
    with process_group(ctx, meeting_in(tmp_path), use_gpu="auto", timeout_s=5) as info:
        assert info.device == torch.device("cpu") and info.gpu_addresses == ("3",)
        assert "Spark assigned GPU 3, but torch has no CUDA support here" in info.device_note


def _join_and_sum_after_stranger(folder: str):
    """Rank 0 of 2 (rank 1 is ``_join_and_sum``): while the group is up, a stranger that
    reaches the port lists the keys and reads every value; returns what it found."""
    ctx, meeting = FakeBarrierContext(0, 2), meeting_in(folder)
    with process_group(ctx, meeting, False, 60):
        address = meeting.store.read_json(meeting.address_file(ctx))
        stranger = dist.TCPStore(
            address["host"], address["port"], is_master=False, timeout=timedelta(seconds=5)
        )
        keys = stranger.list_keys()
        values = [stranger.get(k) for k in keys]
        total = torch.tensor([1.0])
        dist.all_reduce(total)
    return keys, values, total.item()


def test_a_stranger_on_the_rendezvous_port_finds_no_secret_in_its_keys_or_values(tmp_path):
    rank_1 = multiprocessing.get_context("spawn").Process(
        target=_join_and_sum, args=(1, 2, str(tmp_path))
    )
    rank_1.start()
    try:
        keys, values, total = _join_and_sum_after_stranger(str(tmp_path))
    finally:
        rank_1.join(120)
    assert rank_1.exitcode == 0 and total == 3.0
    assert len(keys) >= 2 and all(values)  # the ranks' gloo addresses at least
    everything = b"\n".join([k.encode() for k in keys] + values)
    secret = meeting_in(tmp_path).secret
    assert [f for f in secret_forms(secret) if f in everything] == []
    # nor the addresses the ranks exchange (gloo's sockaddr of 127.0.0.1): values are sealed
    assert socket.inet_aton("127.0.0.1") not in everything


def test_a_rendezvous_that_times_out_records_its_failure_without_the_secret(tmp_path):
    # rank 0 of 2, whose rank 1 never comes: torch's timeout names the keys it waited for
    ctx, meeting = FakeBarrierContext(0, 2), meeting_in(tmp_path)
    record = meeting.run.failure(meeting.launch_id)
    with pytest.raises(RendezvousError, match="rank 0 of 2 could not form") as e:
        with process_group(
            ctx,
            meeting,
            use_gpu=False,
            timeout_s=1,
            on_failure=lambda rank, error: record_failure(record, meeting.store, rank, error),
        ):
            pass
    text = "".join(traceback.format_exception(e.value)).encode()  # the causes too
    assert e.value.__cause__ is not None and "timeout" in text.decode().lower()
    written = meeting.store.read_bytes(record)
    assert json.loads(written)["type"] == "RendezvousError"
    for data in (text, written, str(e.value).encode()):
        assert [f for f in secret_forms(meeting.secret) if f in data] == []


def test_a_failed_rendezvous_removes_rank_0s_address_and_closes_its_port(tmp_path):
    ctx, meeting = FakeBarrierContext(0, 2), meeting_in(tmp_path)  # rank 1 never comes
    path, seen = meeting.address_file(ctx), []

    def watch():  # the address, read as rank 1 would
        while not seen:
            with contextlib.suppress(FileNotFoundError, ValueError):
                seen.append(meeting.store.read_json(path))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with pytest.raises(RendezvousError) as e:
        with process_group(ctx, meeting, use_gpu=False, timeout_s=1):
            pass
    assert not meeting.store.exists(path)
    assert not meeting.store.fs.find(meeting.run.rendezvous)
    watcher.join(5)
    # even while the error is still held (as Spark or a log would), the server has stopped
    assert e.value is not None and seen
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", seen[0]["port"]), timeout=2).close()


@pytest.mark.parametrize("poison", [b"not-a-number", b"1"])
def test_a_failure_count_a_stranger_overwrote_still_records_the_first_failure(tmp_path, poison):
    # a stranger on the port overwrites the job's failure count before the rank fails:
    # torch's server cannot add to b"not-a-number" (it drops the connection: "Did the
    # remote server shutdown"), and b"1" claims that another rank failed first
    ctx, meeting = FakeBarrierContext(0, 1), meeting_in(tmp_path)
    record = meeting.run.failure(meeting.launch_id)
    began = None
    with pytest.raises(ValueError, match="the training code's own error"):
        with process_group(
            ctx,
            meeting,
            use_gpu=False,
            timeout_s=5,
            on_failure=lambda rank, error: record_failure(record, meeting.store, rank, error),
        ):
            address = meeting.store.read_json(meeting.address_file(ctx))
            stranger = dist.PrefixStore(  # the key the ranks' PrefixStore names
                "spark-estimator/",
                dist.TCPStore(
                    address["host"], address["port"], is_master=False, timeout=timedelta(seconds=5)
                ),
            )
            stranger.set(_FAILURES_KEY, poison)
            stranger.get(_FAILURES_KEY)  # the server has it
            began = time.monotonic()
            raise ValueError("the training code's own error")
    assert time.monotonic() - began < LATER_FAILURE_DELAY_S  # raised at once, as the first
    written = meeting.store.read_json(record)
    assert written["type"] == "ValueError" and written["rank"] == 0
    assert "the training code's own error" in written["message"]
    # the record says what happened to the count
    assert "failure count" in written["traceback"] and "tampered" in written["traceback"]


def _join_and_sum(rank: int, world: int, folder: str) -> None:
    torch.set_num_threads(1)
    with process_group(FakeBarrierContext(rank, world), meeting_in(folder), False, 60) as info:
        total = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(total)
    torch.save({"rank": info.rank, "sum": total.item()}, f"{folder}/rank-{rank}.pt")


def test_the_ranks_meet_through_the_store_without_the_barriers_all_gather(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_join_and_sum, args=(r, 3, str(tmp_path))) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    results = [torch.load(tmp_path / f"rank-{r}.pt") for r in range(3)]
    assert results == [{"rank": r, "sum": 6.0} for r in range(3)]
    meeting = meeting_in(tmp_path)
    assert not meeting.store.fs.find(meeting.run.rendezvous)  # none left


TORCHRUN_NAMES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RUN_ID", "MASTER_ADDR",
    "MASTER_PORT",
)  # fmt: skip


def _script_task(task: int, hosts: list[str], folder: str) -> None:
    """A script's task (no group formed here) of a job whose tasks run on ``hosts``: what
    it exports, where it sits, and the address of the TCPStore rank 0's task serves."""
    ctx = FakeBarrierContext(task, len(hosts), hosts=hosts)
    with process_group(
        ctx, meeting_in(folder), False, 60, init_group=False, ranks_by_host=True, run_id="run-1"
    ) as info:
        env = {name: os.environ.get(name) for name in TORCHRUN_NAMES}
        served = meeting_in(folder).store.read_json(meeting_in(folder).address_file(ctx))
        where = (info.rank, info.local_rank, info.cross_rank, info.node_rank, info.num_nodes)
    torch.save({"env": env, "where": where, "served": served}, f"{folder}/task-{task}.pt")


def test_a_scripts_ranks_are_numbered_host_by_host_with_torchruns_node_variables(tmp_path):
    hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.1"]  # tasks 0 and 2 share a host, as Spark
    ctx = multiprocessing.get_context("spawn")  # hands out tasks round-robin over executors
    procs = [ctx.Process(target=_script_task, args=(t, hosts, str(tmp_path))) for t in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    got = [torch.load(tmp_path / f"task-{t}.pt") for t in range(3)]
    # (rank, local rank, cross rank, node rank, nodes): task 2 is rank 1, next to task 0
    assert [g["where"] for g in got] == [(0, 0, 0, 0, 2), (2, 0, 1, 1, 2), (1, 1, 0, 0, 2)]
    for task, rank, local, group in [(0, 0, 0, 0), (1, 2, 0, 1), (2, 1, 1, 0)]:
        assert got[task]["env"] == {
            "RANK": str(rank), "WORLD_SIZE": "3", "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": "3", "ROLE_NAME": "default", "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": "2" if group == 0 else "1", "GROUP_RANK": str(group),
            "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "run-1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": got[task]["env"]["MASTER_PORT"],
        }  # fmt: skip
    served = got[0]["served"]  # by rank 0, task 0: the address every rank connects to
    assert served["host"] == "127.0.0.1" and all(g["served"] == served for g in got)
    assert {g["env"]["MASTER_PORT"] for g in got} == {str(served["port"])}


def test_a_rendezvous_that_cannot_form_is_a_clear_error_within_the_timeout(tmp_path):
    # a port nobody listens on: bound, not listening, for the whole test, so that no other
    # process can listen on it meanwhile (a connection to it is refused)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        ctx, meeting = FakeBarrierContext(1, 2), meeting_in(tmp_path)
        meeting.store.write_json(meeting.address_file(ctx), {"host": "127.0.0.1", "port": port})
        failures = []
        started = time.monotonic()
        with pytest.raises(RendezvousError, match="rendezvous: rank 1 of 2 could not form") as e:
            with process_group(
                ctx,
                meeting,
                use_gpu=False,
                timeout_s=2,
                on_failure=lambda rank, e: failures.append((rank, type(e).__name__)),
            ):
                pass
        assert time.monotonic() - started < 20
        # says how long it took, not that it took the whole timeout
        assert re.search(r"failed after \d+ s \(collective_timeout=2 s\)", str(e.value))
        assert failures == [(1, "RendezvousError")]
        assert not dist.is_initialized()


def test_a_rank_whose_rank_0_never_wrote_its_address_fails_within_the_timeout(tmp_path):
    ctx, meeting = FakeBarrierContext(1, 2), meeting_in(tmp_path)
    started = time.monotonic()
    with pytest.raises(RendezvousError, match="rank 0 wrote no address to .*/3.json"):
        with process_group(ctx, meeting, use_gpu=False, timeout_s=1):
            pass
    assert time.monotonic() - started < 10
    assert not dist.is_initialized()


def _fail_on_rank_0(rank: int, folder: str) -> None:
    """Rank 0 raises while rank 1 waits for it in a collective; each writes what it raised
    and rank 1 what its process printed (to the file descriptor torch's C++ logs to)."""
    torch.set_num_threads(1)
    if rank == 1:
        os.dup2(os.open(f"{folder}/stderr-1.txt", os.O_WRONLY | os.O_CREAT, 0o644), 2)
    rendezvous.LATER_FAILURE_DELAY_S = 0.1  # rank 1 raises soon after it counted
    failures, raised = [], None
    try:
        with process_group(
            FakeBarrierContext(rank, 2),
            meeting_in(folder),
            False,
            60,
            on_failure=lambda rank, error: failures.append(rank),
            on_error=lambda: time.sleep(0.3),  # as the task writes its output lines first
        ):
            if rank == 0:
                time.sleep(0.2)  # rank 1 is in the all_reduce
                raise ValueError("the training code failed on rank 0")
            dist.all_reduce(torch.ones(1))
    except Exception as e:
        raised = f"{type(e).__name__}: {e}"
    torch.save({"raised": raised, "first": failures}, f"{folder}/rank-{rank}.pt")


def test_a_rank_failing_after_rank_0_did_prints_no_cpp_traceback(tmp_path):
    """Rank 0 serves the store: when it fails first, the rank whose collective fails with
    it counts its failure while the store is still there, and torch logs no C++ frames of
    a store that went away (Spark shows a task's output on the driver's console)."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_fail_on_rank_0, args=(r, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    zero, one = (torch.load(tmp_path / f"rank-{r}.pt") for r in range(2))
    assert zero == {"raised": "ValueError: the training code failed on rank 0", "first": [0]}
    assert one["first"] == [] and "ValueError" not in one["raised"]  # a later failure
    printed = (tmp_path / "stderr-1.txt").read_text()
    assert "frame #" not in printed and "Exception raised from" not in printed, printed
