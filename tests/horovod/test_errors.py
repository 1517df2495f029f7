"""hvd.HorovodInternalError: a collective whose peer process is gone raises it (two real
processes, one killed), and it stays a peer failure for the task (the job is retried)."""

import json
import multiprocessing
import os
import signal
import time

import pytest
import torch

import spark_estimator.horovod as hvd
from spark_estimator.horovod.errors import HorovodInternalError, peer_errors
from spark_estimator.shared.failures import is_peer_failure
from spark_estimator.worker.comm.rendezvous import process_group
from tests.worker.comm.test_rendezvous import FakeBarrierContext, meeting_in


def _allreduce_after_peer_dies(rank: int, folder: str) -> None:
    """Both ranks reduce once; then rank 1 kills itself and rank 0 reduces again, writing
    what it caught to ``caught.json``."""
    torch.set_num_threads(1)
    try:
        with process_group(FakeBarrierContext(rank, 2), meeting_in(folder), False, 20):
            hvd.init()
            hvd.allreduce(torch.ones(1), name="both")
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(1.0)  # rank 1 is gone
            try:
                hvd.allreduce(torch.ones(1), name="alone")
            except hvd.HorovodInternalError as e:
                caught = {"type": type(e).__name__, "cause": type(e.__cause__).__name__}
                caught["message"] = str(e)[:300]
                with open(f"{folder}/caught.json", "w") as f:
                    json.dump(caught, f)
    except Exception:
        pass  # leaving a group whose peer is gone fails too


def test_a_collective_whose_peer_is_gone_raises_horovod_internal_error(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_allreduce_after_peer_dies, args=(r, str(tmp_path))) for r in (0, 1)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert procs[1].exitcode == -signal.SIGKILL
    caught = json.loads((tmp_path / "caught.json").read_text())
    assert caught["type"] == "HorovodInternalError"
    assert caught["cause"] in ("RuntimeError", "DistBackendError", "DistNetworkError")
    assert caught["message"].startswith(caught["cause"] + ": ")


def test_it_is_a_peer_failure_and_other_errors_pass_unchanged():
    assert is_peer_failure(HorovodInternalError("gone"))  # the lost rank is the failure

    @peer_errors
    def collective(error):
        raise error

    with pytest.raises(HorovodInternalError) as e:
        collective(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] closed"))
    assert isinstance(e.value.__cause__, RuntimeError)
    with pytest.raises(ValueError, match="root_rank"):  # a caller's mistake stays itself
        collective(ValueError("root_rank: 5 is not a rank"))
