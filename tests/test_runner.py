"""spark_estimator.run: a hand-written function on barrier tasks with real process groups."""

import logging
import os
import sys
import threading
import time
import uuid
import warnings

import numpy as np
import pytest
import torch

from spark_estimator import TrainingError, run
from spark_estimator import distributed as sd
from tests.conftest import LOCAL, spark_session


def probe(scale, offset=0.0, tag="none"):
    """What one rank sees: its place in the job, and the collectives' results."""
    r = sd.rank()
    mine = torch.tensor([1.0, float(r)])
    ints = torch.tensor([r + 1, 10], dtype=torch.int64)
    out = {
        "rank": r,
        "size": sd.size(),
        "local_rank": sd.local_rank(),
        "local_size": sd.local_size(),
        "device": sd.device(),
        "arg": scale * (r + 1) + offset,
        "tag": tag,
        "sum_int": sd.allreduce(r + 1, average=False),
        "avg_int": sd.allreduce(r + 1),
        "avg_float": sd.allreduce(scale * (r + 1)),
        "avg_np32": sd.allreduce(np.float32(r)),
        "sum_np64": sd.allreduce(np.int64(r + 1), average=False),
        "avg_tensor": sd.allreduce(mine),
        "sum_tensor_int": sd.allreduce(ints, average=False),
        "broadcast": sd.broadcast_object({"from": r, "items": [r] * 3}),
        "broadcast_root1": sd.broadcast_object(f"rank {r} says hi", root=1),
    }
    out["input_unchanged"] = torch.equal(mine, torch.tensor([1.0, float(r)]))
    try:
        sd.allreduce("3")
    except TypeError as e:
        out["bad_value"] = str(e)
    sd.barrier()
    return out


@pytest.fixture(scope="module")
def probed():
    return run(
        probe,
        args=(0.5,),
        kwargs={"offset": 100.0, "tag": "kw"},
        num_proc=2,
        use_gpu=False,
        spark=spark_session(LOCAL),
    )


def test_results_come_back_ordered_by_rank(probed):
    assert [p["rank"] for p in probed] == [0, 1]


def test_args_and_kwargs_reach_fn(probed):
    assert [p["arg"] for p in probed] == [100.5, 101.0]
    assert {p["tag"] for p in probed} == {"kw"}


def test_rank_helpers_on_one_host(probed):
    for p in probed:
        assert p["size"] == 2 and p["local_size"] == 2
        assert p["local_rank"] == p["rank"]  # local[4]: every task on one host
        assert p["device"] == torch.device("cpu")


def test_allreduce_of_numbers_keeps_their_kind(probed):
    for p in probed:
        assert p["sum_int"] == 3 and type(p["sum_int"]) is int
        assert p["avg_int"] == 1.5 and type(p["avg_int"]) is float
        assert p["avg_float"] == pytest.approx(0.75) and type(p["avg_float"]) is float
        assert p["avg_np32"] == 0.5 and type(p["avg_np32"]) is np.float32
        assert p["sum_np64"] == 3 and type(p["sum_np64"]) is np.int64
        assert "allreduce: expected a tensor" in p["bad_value"]


def test_allreduce_of_tensors(probed):
    for p in probed:
        assert torch.equal(p["avg_tensor"], torch.tensor([1.0, 0.5]))
        assert torch.equal(p["sum_tensor_int"], torch.tensor([3, 20]))
        assert p["sum_tensor_int"].dtype == torch.int64
        assert p["input_unchanged"]


def test_broadcast_object_gives_roots_object_everywhere(probed):
    assert [p["broadcast"] for p in probed] == [{"from": 0, "items": [0, 0, 0]}] * 2
    assert [p["broadcast_root1"] for p in probed] == ["rank 1 says hi"] * 2


def rank_and_tensor():
    return sd.rank(), torch.full((2,), float(sd.rank()))


def test_rank0_only_returns_rank_0s_value_and_no_cpu_warning_without_gpu(spark):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run(rank_and_tensor, num_proc=2, use_gpu=False, spark=spark, rank0_only=True)
    assert result[0] == 0 and torch.equal(result[1], torch.zeros(2))
    assert not [w for w in caught if "training on CPU" in str(w.message)]


def test_cpu_fallback_is_one_warning_on_the_driver(spark, caplog):
    caplog.set_level(logging.INFO, logger="spark_estimator.worker")
    with pytest.warns(UserWarning) as record:
        assert run(sd.size, num_proc=2, use_gpu=True, spark=spark) == [2, 2]
    fallbacks = [str(w.message) for w in record if "training on CPU" in str(w.message)]
    assert len(fallbacks) == 1
    assert "ranks [0, 1]" in fallbacks[0] and "assigned no GPU" in fallbacks[0]
    assert not [r for r in caplog.records if "assigned no GPU" in r.getMessage()]


def test_spark_defaults_to_the_active_session_and_num_proc_to_every_slot(spark):
    assert run(sd.size, use_gpu=False) == [4, 4, 4, 4]


def fail_on_rank_1():
    print(f"rank {sd.rank()} starts")
    if sd.rank() == 1:
        raise ValueError("boom on rank 1")
    sd.barrier()  # rank 0 waits for rank 1, which never comes


def test_an_error_in_fn_is_a_training_error_with_rank_traceback_and_last_output(spark):
    with pytest.raises(TrainingError) as failure:
        run(fail_on_rank_1, num_proc=2, use_gpu=False, spark=spark)
    error = failure.value
    assert error.rank == 1 and error.remote_type == "ValueError"
    assert error.remote_message == "boom on rank 1"
    assert "in fail_on_rank_1" in error.remote_traceback
    assert error.output == "[rank 1] rank 1 starts"
    message = str(error)
    assert message.startswith("ValueError: boom on rank 1\n")  # the cause comes first
    assert "raised on rank 1" in message and "[rank 1] rank 1 starts" in message
    assert len(message) < 3000  # not Spark's and the JVM's stack traces


def exit_on_rank_1():
    print(f"rank {sd.rank()} starts")
    if sd.rank() == 1:
        print("giving up")
        sys.exit(1)
    sd.barrier()


def test_sys_exit_in_fn_is_a_training_error_with_the_exit_code(spark):
    with pytest.raises(TrainingError) as failure:
        run(exit_on_rank_1, num_proc=2, use_gpu=True, spark=spark)  # on CPU: no GPU line
    error = failure.value
    assert error.rank == 1 and error.remote_type == "SystemExit"
    assert str(error).startswith("SystemExit: sys.exit(1)\n")
    assert error.output == "[rank 1] rank 1 starts\n[rank 1] giving up"
    assert "in exit_on_rank_1" in error.remote_traceback
    assert len(str(error)) < 3000


def talk():
    print(f"printed on rank {sd.rank()}")
    logging.getLogger("user.code").info("logged on rank %d", sd.rank())
    return sd.rank()


def test_what_the_ranks_print_and_log_is_logged_on_the_driver_per_rank(spark, caplog):
    caplog.set_level(logging.INFO, logger="spark_estimator.worker")
    assert run(talk, num_proc=2, use_gpu=False, spark=spark) == [0, 1]
    lines = [r.getMessage() for r in caplog.records if r.name == "spark_estimator.worker"]
    assert lines == [
        "[rank 0] printed on rank 0",
        "[rank 0] INFO user.code: logged on rank 0",
        "[rank 1] printed on rank 1",
        "[rank 1] INFO user.code: logged on rank 1",
    ]


def hang_on_rank_1():
    if sd.rank() == 1:
        time.sleep(3600)  # stuck outside any collective
    return sd.allreduce(1.0)


def test_a_rank_that_hangs_makes_the_others_raise_after_collective_timeout(spark):
    started = time.monotonic()
    with pytest.raises(Exception, match="Timed out"):
        run(hang_on_rank_1, num_proc=2, use_gpu=False, spark=spark, collective_timeout=2)
    assert time.monotonic() - started < 60  # the default timeout is 600 s


def lock_on_rank_1():
    return threading.Lock() if sd.rank() == 1 else "fine"


def test_only_the_returned_values_must_be_picklable(spark):
    assert run(lock_on_rank_1, num_proc=2, use_gpu=False, spark=spark, rank0_only=True) == "fine"
    with pytest.raises(Exception, match="fn: the return value on rank 1 .*cannot be serialized"):
        run(lock_on_rank_1, num_proc=2, use_gpu=False, spark=spark)


def _bad_inputs():
    lock = threading.Lock()
    return {
        "fn not callable": (dict(fn=42), TypeError, "fn: expected a function, got int"),
        "fn not picklable": (
            dict(fn=lambda: lock.locked()),
            TypeError,
            "fn: cannot be serialized",
        ),
        "unpicklable arg": (dict(args=(lock,)), TypeError, "args: cannot be serialized"),
        "unpicklable kwarg": (
            dict(kwargs={"lock": lock}),
            TypeError,
            "kwargs: cannot be serialized",
        ),
        "args not a sequence": (dict(args=5), TypeError, "args: expected a tuple or list"),
        "num_proc 0": (dict(num_proc=0), ValueError, "num_proc: must be >= 1, got 0"),
        "collective_timeout 0": (
            dict(collective_timeout=0),
            ValueError,
            "collective_timeout: must be > 0",
        ),
        "collective_timeout not a number": (
            dict(collective_timeout="10"),
            TypeError,
            "collective_timeout: expected seconds",
        ),
        "num_proc above slots": (
            dict(num_proc=5),
            ValueError,
            "num_proc: 5 .* only 4 tasks at once",
        ),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_bad_input_is_rejected_on_the_driver_before_any_job(case, spark):
    call = dict(fn=sd.size, num_proc=2, use_gpu=False, spark=spark)
    overrides, error, message = _bad_inputs()[case]
    call.update(overrides)
    group = f"bad-run-{uuid.uuid4().hex}"
    spark.sparkContext.setJobGroup(group, case)
    try:
        with pytest.raises(error, match=message):
            run(**call)
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
    assert list(spark.sparkContext.statusTracker().getJobIdsForGroup(group)) == []


def pid_and_sum():
    return os.getpid(), sd.local_rank(), sd.allreduce(torch.tensor([sd.rank() + 1.0]), False)


@pytest.mark.cluster
def test_two_executor_processes_run_fn_and_allreduce(cluster_spark):
    results = run(pid_and_sum, num_proc=2, use_gpu=False, spark=cluster_spark)
    pids = {pid for pid, _, _ in results}
    assert len(pids) == 2 and os.getpid() not in pids
    assert [local for _, local, _ in results] == [0, 1]  # both executors on this host
    assert all(torch.equal(total, torch.tensor([3.0])) for _, _, total in results)
