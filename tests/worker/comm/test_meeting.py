import threading
import time
from datetime import timedelta

import torch.distributed as dist

from spark_estimator.worker.comm.meeting import _FAILURES_KEY, await_failures, first_failure
from spark_estimator.worker.comm.sealed_store import SealedStore


def test_once_a_rank_replaced_a_forged_failure_count_the_next_failing_rank_is_not_first():
    timeout = timedelta(seconds=5)
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
    secret = "3a7d1f09c4e2b8656d0e9a1f7c3b5e28"

    def rank_store():
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)
        return SealedStore(dist.PrefixStore("spark-estimator/", client), secret)

    rank_1, rank_2 = rank_store(), rank_store()
    stranger = dist.PrefixStore("spark-estimator/", server)
    stranger.set(_FAILURES_KEY, b"not-a-number")
    assert first_failure(rank_1) == (True, True)  # first, over a tampered count
    assert first_failure(rank_2) == (False, False)
    stranger.delete_key(_FAILURES_KEY)
    assert first_failure(rank_2) == (True, False)  # a deleted count starts again


def job_store(ranks: int = 2):
    """rank 0's server and each rank's sealed store of it (rank 0's through its server)."""
    timeout = timedelta(seconds=5)
    server = dist.TCPStore(
        "127.0.0.1", 0, ranks, is_master=True, timeout=timeout, wait_for_workers=False
    )
    secret = "3a7d1f09c4e2b8656d0e9a1f7c3b5e28"
    clients = [server] + [
        dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)
        for _ in range(ranks - 1)
    ]
    return server, [SealedStore(dist.PrefixStore("spark-estimator/", c), secret) for c in clients]


def test_rank_0_leaving_after_a_failure_waits_for_the_others_to_count_theirs():
    _, (zero, one) = job_store()
    assert first_failure(zero) == (True, False)
    began = time.monotonic()
    await_failures(zero, 2, timeout_s=0.3)  # rank 1 never counts
    assert 0.3 <= time.monotonic() - began < 2
    counting = threading.Timer(0.2, first_failure, [one])
    counting.start()
    began = time.monotonic()
    await_failures(zero, 2, timeout_s=10)
    assert time.monotonic() - began < 5  # returned on the count, long before its timeout
    assert zero.add(_FAILURES_KEY, 0) == 2  # rank 1's counted (its thread may still be ending)
    counting.join()


def test_a_rank_failing_after_rank_0_left_asks_its_store_nothing(capfd):
    server, (zero, one) = job_store()
    first_failure(zero)
    del server, zero  # rank 0's process ended: its port refuses connections
    assert first_failure(one) == (False, False)
    printed = capfd.readouterr().err
    assert "frame #" not in printed and "Exception raised from" not in printed, printed
