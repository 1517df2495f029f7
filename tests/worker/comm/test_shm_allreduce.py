"""The shared-memory gradient allreduce between real processes (spawned, joined by a real
gloo group over a FileStore)."""

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

from spark_estimator.shared.failures import SHM_TAG, is_peer_failure
from spark_estimator.worker.comm import shm_allreduce
from spark_estimator.worker.comm.shm_allreduce import SLOT_BYTES, SharedMemoryAllreduce

pytestmark = pytest.mark.skipif(
    shm_allreduce.shm_folder() is None, reason="needs Linux x86-64 with a writable /dev/shm"
)
WORLD = 2


def _join(rank: int, folder: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(folder, "pg-store"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)


def _tensors(rank: int) -> list[torch.Tensor]:
    """Per rank: fp32 over three slots' worth (chunked), bf16, float64; all different."""
    g = torch.Generator().manual_seed(rank)
    return [
        torch.randn(3 * SLOT_BYTES // 4 + 5, generator=g),
        torch.randn(1000, generator=g).to(torch.bfloat16),
        torch.randn(10, generator=g, dtype=torch.float64),
    ]


def _average(rank: int, folder: str) -> None:
    _join(rank, folder)
    shared = SharedMemoryAllreduce.open(rank, WORLD, timeout_s=60)
    mine = f"spark-estimator-{os.getpid()}-"  # rank 0 names the file after its pid
    files = [f for f in os.listdir("/dev/shm") if f.startswith(mine)]
    averaged = [shared.average_(t) for t in _tensors(rank)]
    expected = []
    for t in _tensors(rank):
        dist.all_reduce(t)
        expected.append(t / WORLD)
    calls, chunks = shared.calls, shared.sequence
    shared.close()
    if rank == 1:  # one rank cannot use shared memory: nobody does
        shm_allreduce.shm_folder = lambda: None
    fallback = SharedMemoryAllreduce.open(rank, WORLD, timeout_s=60)
    torch.save(
        {
            "averaged": averaged,
            "expected": expected,
            "calls": calls,
            "chunks": chunks,
            "files": files,
            "fallback": fallback,
        },
        os.path.join(folder, f"rank-{rank}.pt"),
    )
    dist.destroy_process_group()


def _peer_lost(rank: int, folder: str, how: str) -> None:
    _join(rank, folder)
    shared = SharedMemoryAllreduce.open(rank, WORLD, timeout_s=2)
    if rank == 1:
        if how == "hangs":
            time.sleep(6)
        if how == "leaves":  # its training failed: it closes and lives on (a reused worker)
            shared.close()
            time.sleep(6)
        os._exit(0)  # dies without a word: no exception, no closed collective
    start = time.monotonic()
    try:
        shared.average_(torch.ones(10))
        outcome = {"error": None}
    except RuntimeError as e:
        outcome = {"error": str(e), "peer": is_peer_failure(e)}
    outcome["seconds"] = time.monotonic() - start
    torch.save(outcome, os.path.join(folder, "rank-0.pt"))
    os._exit(0)  # the group's peer is gone: skip the teardown that would wait for it


def _spawn(target, folder, *args) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, str(folder), *args)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0


def test_every_rank_gets_the_same_mean_as_gloo_and_no_file_is_left(tmp_path):
    _spawn(_average, tmp_path)
    ranks = [torch.load(tmp_path / f"rank-{r}.pt") for r in range(WORLD)]
    for got, want in zip(ranks[0]["averaged"], ranks[0]["expected"]):
        assert got.dtype == want.dtype
        rtol = 1e-2 if got.dtype == torch.bfloat16 else 1e-6
        assert torch.allclose(got.double(), want.double(), rtol=rtol)
    for a, b in zip(ranks[0]["averaged"], ranks[1]["averaged"]):
        assert torch.equal(a, b)  # bitwise: the replicas never drift apart
    assert ranks[0]["calls"] == 3 and ranks[0]["chunks"] == 4 + 1 + 1  # fp32 in 4 chunks
    assert ranks[0]["files"] == []  # unlinked once every rank had mapped it
    assert [r["fallback"] for r in ranks] == [None, None]


@pytest.mark.parametrize("how", ["dies", "leaves", "hangs"])
def test_a_peer_that_dies_leaves_or_hangs_ends_the_wait_with_a_peer_failure(tmp_path, how):
    _spawn(_peer_lost, tmp_path, how)
    outcome = torch.load(tmp_path / "rank-0.pt")
    assert outcome["error"] and SHM_TAG in outcome["error"] and outcome["peer"]
    if how == "dies":
        assert "rank 1" in outcome["error"] and "ended" in outcome["error"]
        assert outcome["seconds"] < 2  # noticed by its pid, not by the timeout
    elif how == "leaves":
        assert "rank 1" in outcome["error"] and "left" in outcome["error"]
        assert outcome["seconds"] < 2  # noticed by its mark, not by the timeout
    else:
        assert "collective_timeout=2" in outcome["error"]
        assert 2 <= outcome["seconds"] < 5
