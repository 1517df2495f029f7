import pytest
import torch.distributed as dist

from spark_estimator.shared.failures import (
    SHM_TAG,
    TrainingError,
    is_peer_failure,
    is_retried,
    read_failure,
    record_failure,
)


def test_only_errors_about_a_peer_count_as_peer_failures():
    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"
    )
    assert is_peer_failure(gloo)
    assert is_peer_failure(dist.DistBackendError("NCCL communicator was aborted"))
    # the shared-memory allreduce's error, as DDP re-raises it from its communication hook
    assert is_peer_failure(RuntimeError(f"{SHM_TAG} rank 0: the process of rank 1 ended"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_failure(ValueError("gloo/ in a user's message is not a peer failure"))


def test_peer_failures_and_io_errors_are_retried_other_exceptions_not():
    assert is_retried(dist.DistNetworkError("peer gone"))
    assert is_retried(ConnectionResetError("store connection reset"))
    assert is_retried(OSError("s3: service unavailable"))
    assert not is_retried(ValueError("bad value"))
    assert not is_retried(RuntimeError("CUDA out of memory"))


def test_a_recorded_failure_comes_back_as_a_training_error(store):
    path = store.run("r1").failure("launch-1")
    assert read_failure(path, store) is None
    try:
        raise KeyError("no such column")
    except KeyError as e:
        record_failure(path, store, 3, e)
    error = TrainingError("r1", read_failure(path, store))
    assert (error.rank, error.remote_type) == (3, "KeyError")
    assert str(error).startswith("KeyError: 'no such column'\n(raised on rank 3 of run 'r1';")
    assert 'raise KeyError("no such column")' in error.remote_traceback
    with pytest.raises(RuntimeError):  # catchable as a RuntimeError
        raise error
