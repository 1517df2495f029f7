from datetime import timedelta

import torch.distributed as dist

from spark_estimator.worker.comm.meeting import _FAILURES_KEY, first_failure
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
