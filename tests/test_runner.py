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
from spark_estimator.runner import _modules_beside
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


def test_the_default_use_gpu_runs_on_cpu_without_a_warning(spark, capfd):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run(sd.size, num_proc=2, spark=spark) == [2, 2]
    assert not caught
    assert "GPU" not in capfd.readouterr().err


def test_use_gpu_true_without_gpus_configured_is_refused_before_any_job(spark):
    with pytest.raises(ValueError, match=r"use_gpu: True .*spark.task.resource.gpu.amount"):
        run(sd.size, num_proc=2, use_gpu=True, spark=spark)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_use_gpu_other_than_auto_true_or_false_is_refused_naming_it(spark, value):
    with pytest.raises(TypeError, match="use_gpu: expected 'auto', True or False"):
        run(sd.size, num_proc=2, use_gpu=value, spark=spark)


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
        run(exit_on_rank_1, num_proc=2, spark=spark)  # on CPU: no GPU line
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
        "fn not callable": (
            dict(fn=42),
            TypeError,
            "fn: expected a function or a script's path, got int",
        ),
        "script missing": (dict(fn="/nonexistent/train.py"), FileNotFoundError, "fn: no script"),
        "script kwargs": (
            dict(fn=__file__, kwargs={"a": 1}),
            TypeError,
            "kwargs: a script takes no kwargs",
        ),
        "script args not str": (
            dict(fn=__file__, args=[1]),
            TypeError,
            "args: a script's arguments must be strings",
        ),
        "env not str": (dict(env={"A": 1}), TypeError, "env: expected a dict"),
        "stdout not a file": (dict(stdout="out.txt"), TypeError, "stdout: expected a file-like"),
        "stderr not a file": (dict(stderr=42), TypeError, "stderr: expected a file-like"),
        "verbose negative": (dict(verbose=-1), ValueError, "verbose: must be >= 0"),
        "verbose not int": (dict(verbose="2"), TypeError, "verbose: expected an int"),
        "max_restarts negative": (dict(max_restarts=-1), ValueError, "max_restarts: must be >= 0"),
        "start_timeout 0": (dict(start_timeout=0), ValueError, "start_timeout: must be > 0"),
        "min_num_proc 0": (dict(min_num_proc=0), ValueError, "min_num_proc: must be >= 1"),
        "min_num_proc above num_proc": (
            dict(num_proc=2, min_num_proc=3),
            ValueError,
            "min_num_proc: 3 is more than num_proc=2",
        ),
        "max_num_proc 0": (dict(max_num_proc=0), ValueError, "max_num_proc: must be >= 1"),
        "max_num_proc not int": (dict(max_num_proc=2.0), TypeError, "max_num_proc: expected an"),
        "max_num_proc below num_proc": (
            dict(num_proc=3, max_num_proc=2),
            ValueError,
            "max_num_proc: 2 is less than num_proc=3",
        ),
        "min_num_proc above max_num_proc": (
            dict(min_num_proc=3, max_num_proc=2),
            ValueError,
            "min_num_proc: 3 is more than max_num_proc=2",
        ),
        "elastic_timeout 0": (dict(elastic_timeout=0), ValueError, "elastic_timeout: must be > 0"),
        "store not a store": (dict(store=42), TypeError, "store: expected a Store or a URL"),
        "run_id with a slash": (dict(run_id="a/b"), ValueError, "run_id: expected a folder"),
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
        "stage_level_scheduling not a bool": (
            dict(stage_level_scheduling="off"),
            TypeError,
            "stage_level_scheduling: expected True or False, got 'off'",
        ),
        "num_proc above slots": (
            dict(num_proc=5, start_timeout=0.5),
            ValueError,
            r"num_proc: 5 .* only 4 tasks at once \(counted within start_timeout=0.5 s\)",
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


# -- script mode, output, env ------------------------------------------------------------


class Recorder:
    """A file-like object on the driver that keeps the lines written to it, and calls
    ``on_line(line)`` for each as it arrives."""

    def __init__(self, on_line=None):
        self.lines: list[str] = []
        self.on_line = on_line
        self.partial = ""

    def write(self, text: str) -> int:
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            self.lines.append(line)
            if self.on_line is not None:
                self.on_line(line)
        return len(text)

    def flush(self) -> None:
        pass


TORCHRUN_SCRIPT = """
import os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"]
print("env", " ".join(os.environ[n] for n in names), sys.argv[1:])
nodes = ["GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID"]
print("nodes", " ".join(os.environ[n] for n in nodes))
print("argv[0]", sys.argv[0], "__file__", __file__)
print("master set", bool(os.environ["MASTER_ADDR"]), int(os.environ["MASTER_PORT"]) > 0)
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
print("sum", total.item(), "of", dist.get_world_size())
dist.destroy_process_group()
"""


def test_a_torchrun_style_script_forms_its_group_from_the_environment(spark, tmp_path):
    script = tmp_path / "train_torchrun.py"
    script.write_text(TORCHRUN_SCRIPT)
    out, err = Recorder(), Recorder()
    given = os.path.relpath(script)  # as a command line names it
    result = run(
        given, args=["--epochs", "3"], num_proc=2, use_gpu=False, spark=spark,
        stdout=out, stderr=err, run_id="torchrun-env",
    )  # fmt: skip
    assert result is None
    for r in (0, 1):
        assert f"[rank {r}] env {r} 2 {r} 2 ['--epochs', '3']" in out.lines
        # one host: node 0 of 1; torchrun's variables that make Lightning read RANK
        assert f"[rank {r}] nodes 0 1 {r} 2 torchrun-env" in out.lines
        # as `python train_torchrun.py` sets them (and the docs say), not a copy's
        assert f"[rank {r}] argv[0] {given} __file__ {script}" in out.lines
        assert f"[rank {r}] master set True True" in out.lines
        assert f"[rank {r}] sum 3.0 of 2" in out.lines
    assert err.lines == []


BESIDE_SCRIPT = """
import datautils
from helpers.more import VALUE  # a package in a subfolder: on sys.path through the folder
print("imported", datautils.NAME, VALUE)
"""


def test_a_script_imports_the_modules_beside_it_from_another_working_directory(spark, tmp_path):
    """As under torchrun, which puts the script's folder on sys.path (PyTorch's own
    ddp-tutorial-series/multigpu_torchrun.py imports datautils from beside it)."""
    folder = tmp_path / "ddp-tutorial"
    (folder / "helpers").mkdir(parents=True)
    (folder / "train.py").write_text(BESIDE_SCRIPT)
    (folder / "datautils.py").write_text("NAME = 'datautils'\n")
    (folder / "helpers" / "__init__.py").write_text("")
    (folder / "helpers" / "more.py").write_text("VALUE = 42\n")
    assert os.getcwd() != str(folder)
    out = Recorder()
    run(str(folder / "train.py"), num_proc=2, use_gpu=False, spark=spark, stdout=out)
    assert sorted(out.lines) == ["[rank 0] imported datautils 42", "[rank 1] imported datautils 42"]
    # the tasks' Python workers, reused, keep neither the folder on sys.path nor its modules
    leftovers = run(_script_leftovers, args=(str(folder),), num_proc=2, use_gpu=False, spark=spark)
    assert leftovers == [[]] * 2


def _script_leftovers(folder: str) -> list[str]:
    names = [
        n for n, m in sys.modules.items() if (getattr(m, "__file__", None) or "").startswith(folder)
    ]
    return names + [p for p in sys.path if p.startswith(folder)]


def test_the_modules_beside_a_script_are_shipped_within_a_cap_else_refused_naming_them(
    tmp_path, monkeypatch
):
    """For executors that do not see the driver's filesystem: the .py files in the
    script's folder, not its subfolders nor other files."""
    (tmp_path / "helpers").mkdir()
    (tmp_path / "train.py").write_text("import datautils\n")
    (tmp_path / "datautils.py").write_bytes(b"NAME = 'caf\xc3\xa9'\n")
    (tmp_path / "notes.txt").write_text("not a module\n")
    (tmp_path / "helpers" / "more.py").write_text("VALUE = 42\n")
    assert _modules_beside(str(tmp_path / "train.py")) == {
        "datautils.py": b"NAME = 'caf\xc3\xa9'\n"
    }
    (tmp_path / "big.py").write_text("x = 1\n" * 100)
    monkeypatch.setattr("spark_estimator.runner.MODULES_MAX_BYTES", 300)
    with pytest.raises(ValueError, match=r"fn: the \.py modules beside .* \(big\.py 600 B, "):
        _modules_beside(str(tmp_path / "train.py"))


LIGHTNING_SCRIPT = """
import os, sys
from datetime import timedelta
import torch
import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, index):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


devices, num_nodes = int(sys.argv[1]), int(sys.argv[2])
# strategy="ddp", with a bound on the wait for the group (ranks that disagree on who is
# who wait for each other, by default for 30 minutes)
trainer = pl.Trainer(
    strategy=DDPStrategy(timeout=timedelta(seconds=90)), accelerator="cpu", devices=devices,
    num_nodes=num_nodes, max_steps=1, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False,
)
data = torch.utils.data.TensorDataset(torch.randn(8 * devices * num_nodes, 2))
trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
said = [os.environ[n] for n in ("RANK", "GROUP_RANK", "LOCAL_RANK", "WORLD_SIZE")]
print(
    "ranks", *said, trainer.global_rank, trainer.node_rank, trainer.local_rank,
    trainer.world_size, type(trainer.strategy.cluster_environment).__name__,
)
"""


def lightning_ranks(lines: list[str]) -> dict[int, list[str]]:
    """What each rank of LIGHTNING_SCRIPT printed: its variables (RANK, GROUP_RANK,
    LOCAL_RANK, WORLD_SIZE), then the Trainer's view (global, node and local rank, world
    size) and Lightning's cluster environment."""
    found = [line.split() for line in lines if " ranks " in line]
    return {int(words[1].rstrip("]")): words[3:] for words in found}


def test_a_lightning_script_takes_torchruns_ranks_and_logs_each_line_once(spark, tmp_path):
    pytest.importorskip("lightning")
    script = tmp_path / "train_lightning.py"
    script.write_text(LIGHTNING_SCRIPT)
    out, err = Recorder(), Recorder()
    run(
        str(script), args=["2", "1"], num_proc=2, use_gpu=False, spark=spark, stdout=out, stderr=err
    )
    assert lightning_ranks(out.lines) == {
        r: [str(r), "0", str(r), "2", str(r), "0", str(r), "2", "TorchElasticEnvironment"]
        for r in (0, 1)
    }
    # Lightning's own handler on the "lightning" logger writes to stderr, which the rank
    # captures: its records are not captured a second time from the root logger
    said = [line for line in err.lines if "GPU available" in line]
    assert said == ["[rank 0] INFO: GPU available: False, used: False"], err.lines
    assert not [line for line in err.lines if "INFO lightning" in line], err.lines


LIVE_SCRIPT = """
import os, sys, time
flag = sys.argv[1]
print("waiting for the driver")
sys.stdout.flush()
for _ in range(1200):  # the driver creates the flag when it has the line above
    if os.path.exists(flag):
        break
    time.sleep(0.1)
else:
    sys.exit("the driver never got the line while the script ran")
print("the driver had it")
"""


def test_lines_reach_the_driver_while_the_script_runs(spark, tmp_path):
    """The script waits for a file that the driver's stdout object creates on receiving the
    script's first line: the run only completes if that line arrived before its end."""
    script, flag = tmp_path / "live.py", tmp_path / "flag"
    script.write_text(LIVE_SCRIPT)

    def on_line(line):
        if line == "[rank 0] waiting for the driver":
            flag.touch()

    out = Recorder(on_line)
    run(str(script), args=[str(flag)], num_proc=1, use_gpu=False, spark=spark, stdout=out)
    assert out.lines == ["[rank 0] waiting for the driver", "[rank 0] the driver had it"]


def chatty():
    print(f"out of rank {sd.rank()}")
    print(f"err of rank {sd.rank()}", file=sys.stderr)
    logging.getLogger("user.code").warning("logged on rank %d", sd.rank())
    return os.environ.get("MY_SETTING"), os.environ.get("RANK")


def test_env_is_set_on_every_rank_and_lines_go_to_stdout_and_stderr_by_stream(spark):
    out, err = Recorder(), Recorder()
    values = run(
        chatty, num_proc=2, use_gpu=False, spark=spark, env={"MY_SETTING": "on"},
        stdout=out, stderr=err,
    )  # fmt: skip
    assert values == [("on", None), ("on", None)]  # RANK: only scripts get torchrun's env
    assert sorted(out.lines) == ["[rank 0] out of rank 0", "[rank 1] out of rank 1"]
    assert sorted(err.lines) == [
        "[rank 0] WARNING user.code: logged on rank 0",
        "[rank 0] err of rank 0",
        "[rank 1] WARNING user.code: logged on rank 1",
        "[rank 1] err of rank 1",
    ]
    # the variables do not outlive the task in Spark's reused Python workers
    assert run(chatty, num_proc=2, use_gpu=False, spark=spark, verbose=0) == [(None, None)] * 2


def test_verbose_0_prints_nothing_and_2_says_where_each_rank_runs(spark, capsys):
    run(talk, num_proc=2, use_gpu=False, spark=spark, verbose=0)
    assert "[rank" not in capsys.readouterr().err
    err = Recorder()
    run(talk, num_proc=2, use_gpu=False, spark=spark, verbose=2, stderr=err)
    for r in (0, 1):
        assert any(
            line.startswith(f"[rank {r}] spark-estimator: rank {r} of 2 on ")
            and ", pid " in line
            and ", device cpu, task attempt " in line
            for line in err.lines
        ), err.lines


def test_each_rank_records_its_host_pid_and_attempt_in_the_store(spark, store):
    pids = run(os.getpid, num_proc=2, use_gpu=False, spark=spark, store=store, run_id="where")
    for r, pid in enumerate(pids):
        record = store.read_json(store.run("where").process(r))
        assert record["rank"] == r and record["pid"] == pid and record["host"]
        assert isinstance(record["attempt"], int) and record["launch_id"]


FAILING_SCRIPT = """
import sys
import torch.distributed as dist
dist.init_process_group("gloo")
print("rank", dist.get_rank(), "starts")
if dist.get_rank() == 1:
    raise ValueError("boom in the script")
dist.barrier()
"""


def test_a_failing_script_rank_is_a_training_error_and_sys_exit_0_is_success(spark, tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(FAILING_SCRIPT)
    with pytest.raises(TrainingError) as failure:
        run(str(script), num_proc=2, use_gpu=False, spark=spark, verbose=0)
    error = failure.value
    assert error.rank == 1 and error.remote_type == "ValueError"
    assert 'fails.py", line 7' in error.remote_traceback
    assert error.output == "[rank 1] rank 1 starts"
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nprint('bye')\nsys.exit(0)\n")
    out = Recorder()
    assert run(exits, num_proc=2, use_gpu=False, spark=spark, stdout=out) is None
    assert sorted(out.lines) == ["[rank 0] bye", "[rank 1] bye"]
