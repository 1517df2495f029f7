"""A one-rank job formed as a task forms it (rendezvous.process_group), for unit tests."""

import pytest

import spark_estimator.horovod as hvd
from spark_estimator.worker.comm.rendezvous import process_group
from tests.worker.comm.test_rendezvous import FakeBarrierContext, meeting_in


@pytest.fixture
def one_rank(tmp_path):
    """Inside a one-rank task's process group; hvd not initialised yet."""
    meeting = meeting_in(tmp_path / "store")
    with process_group(FakeBarrierContext(0, 1), meeting, use_gpu=False, timeout_s=10) as info:
        yield info
        hvd.shutdown()
