"""What a fit shows and leaves behind: the ranks' output on the driver, the progress bar,
TensorBoard event files, MLflow logging, and the last lines in a TrainingError."""

import logging
import math
import subprocess
import sys

import pytest
import torch

from spark_estimator import TrainingError
from spark_estimator.callbacks import Callback
from tests.conftest import linear_net, make_estimator, run_user_script
from tests.faults import Fault

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
mlflow = pytest.importorskip("mlflow")


class Talk(Callback):
    """Prints and logs on every rank; raises on ``fail_rank`` at ``fail_epoch``."""

    def __init__(self, fail_rank=None, fail_epoch=None):
        self.fail_rank, self.fail_epoch = fail_rank, fail_epoch

    def on_epoch_end(self, epoch, logs, state):
        print(f"printed by rank {state.rank} after epoch {epoch}")
        logging.getLogger("user.training").warning("logged by rank %d", state.rank)
        if (state.rank, epoch) == (self.fail_rank, self.fail_epoch):
            raise ValueError("the user's callback failed")


def test_a_fit_reports_to_the_driver_tensorboard_and_mlflow(
    regression_df, store, tmp_path, caplog, capsys, mlflow_tracking
):
    caplog.set_level(logging.INFO, logger="spark_estimator.worker")
    model = make_estimator(
        store=store, epochs=2, validation=0.25, callbacks=[Talk()], mlflow_logging=True
    ).fit(regression_df)

    lines = [r.getMessage() for r in caplog.records if r.name == "spark_estimator.worker"]
    for rank in (0, 1):
        assert f"[rank {rank}] printed by rank {rank} after epoch 2" in lines
        assert f"[rank {rank}] WARNING user.training: logged by rank {rank}" in lines
    err = capsys.readouterr().err
    assert "epoch 2/2" in err and "val_loss=" in err  # the bar (verbose is on by default)
    # where the last epoch's time went, over all ranks (MLflow's own lines may follow)
    bar = [line for line in err.splitlines() if "epoch 2/2" in line][-1]
    assert all(f"{kind}=" in bar.split("\r")[-1] for kind in ("data", "comp", "comm"))

    history = model.getHistory()
    events = store.run(model.getRunId()).tensorboard
    acc = event_accumulator.EventAccumulator(str(events))
    acc.Reload()
    logged = [(e.step, e.value) for e in acc.Scalars("validation/loss")]
    assert logged == [
        (r["epoch"], pytest.approx(r["validation"]["loss"], rel=1e-6)) for r in history
    ]

    [run] = mlflow_tracking.search_runs(mlflow_tracking.search_experiments()[0].experiment_id)
    assert run.info.run_name == model.getRunId()
    assert run.data.params["epochs"] == "2"
    assert run.data.metrics["train/loss"] == pytest.approx(history[-1]["train"]["loss"])


def test_tensorboard_has_the_loss_every_n_steps_on_one_axis_across_a_resume(regression_df, store):
    """log_every_steps=2: rank 0's step scalars every 2 batches; fitting the run again with
    more epochs goes on along the same axis, each step once."""
    params = dict(store=store, run_id="steps", log_every_steps=2, verbose=False)
    make_estimator(epochs=1, **params).fit(regression_df)
    model = make_estimator(epochs=2, **params).fit(regression_df)
    assert model.getTrainingSummary()["resumed_from_epoch"] == 1

    acc = event_accumulator.EventAccumulator(str(store.run("steps").tensorboard))
    acc.Reload()
    [(steps, first), (end, second)] = [(e.step, e.value) for e in acc.Scalars("step/epoch")]
    assert (first, second, end) == (1.0, 2.0, 2 * steps)  # 200 rows, 2 ranks, 16 a batch: 7
    losses = [(e.step, e.value) for e in acc.Scalars("step/train_loss")]
    assert [step for step, _ in losses] == list(range(2, end + 1, 2))
    assert all(math.isfinite(v) and v > 0 for _, v in losses) and losses[-1][1] < losses[0][1]
    assert [e.value for e in acc.Scalars("step/lr_group_0")] == [pytest.approx(0.1)] * len(losses)
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (r["epoch"], pytest.approx(r["train"]["loss"], rel=1e-6)) for r in model.getHistory()
    ]


def test_not_verbose_shows_no_bar(regression_df, store, capsys):
    make_estimator(store=store, epochs=1, verbose=False).fit(regression_df)
    assert "epoch 1/1" not in capsys.readouterr().err


def test_a_training_error_shows_the_failing_ranks_last_lines(regression_df, store):
    est = make_estimator(
        store=store, epochs=3, callbacks=[Talk(fail_rank=1, fail_epoch=2)], use_gpu="auto"
    )
    with pytest.raises(TrainingError, match="the user's callback failed") as failure:
        est.fit(regression_df)
    assert failure.value.rank == 1
    assert "[rank 1] printed by rank 1 after epoch 2" in failure.value.output
    assert "rank 0" not in failure.value.output
    assert "(last output of rank 1:)\n[rank 1] printed by rank 1 after epoch 1" in str(
        failure.value
    )
    # the default use_gpu on a CPU-only Spark: no GPU line in the ranks' output
    assert "GPU" not in str(failure.value)


def test_mlflow_logging_without_mlflow_is_refused_before_any_job(regression_df, store, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "mlflow", None)
    net = linear_net()
    est = make_estimator(
        net, store, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), mlflow_logging=True
    )
    with pytest.raises(ValueError, match="mlflow_logging: MLflow is not installed"):
        est.fit(regression_df)
    assert not (store.root and __import__("os").listdir(store.root))


def test_a_job_started_again_shows_each_line_once(regression_df, store, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="spark_estimator.worker")
    fault = Fault("kill", rank=1, epoch=2, marker=tmp_path / "m")
    make_estimator(store=store, epochs=3, callbacks=[Talk(), fault]).fit(regression_df)
    assert (tmp_path / "m").exists()
    lines = [r.getMessage() for r in caplog.records if r.name == "spark_estimator.worker"]
    # epoch 1's line was printed by the first launch only; the second resumed after it
    assert lines.count("[rank 0] printed by rank 0 after epoch 1") == 1
    assert lines.count("[rank 0] printed by rank 0 after epoch 3") == 1


DEFAULT_FIT = """
import torch
from pyspark.sql import SparkSession
from spark_estimator import Store, TorchEstimator

spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
spark.sparkContext.setLogLevel("ERROR")
rows = [([float(i), 1.0], 2.0 * i) for i in range(64)]
df = spark.createDataFrame(rows, "x array<double>, y double")
net = torch.nn.Linear(2, 1)
TorchEstimator(
    model=net, optimizer=torch.optim.SGD(net.parameters(), lr=1e-3), loss=torch.nn.MSELoss(),
    feature_cols=["x"], label_cols=["y"], batch_size=16, epochs=1, num_proc=2,
    store=Store.create({store!r}),
).fit(df)
print("fitted")
"""


def test_a_default_fit_on_a_cluster_without_gpus_shows_no_gpu_warning(tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(DEFAULT_FIT.format(store=str(tmp_path / "store")))
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "fitted" in done.stdout, done.stderr[-3000:]
    assert "GPU" not in done.stdout + done.stderr
    assert "Warning" not in done.stderr


# A user's script, run as a user runs it (python script.py in a terminal): a plain fit whose
# forward() prints once per rank (its learning rate scaled), then a fit whose loss raises in
# its second epoch on rank 0 (whose task serves the job's TCPStore), rank 1 waiting for it
# in the gradients' allreduce; the session stopped at once after it.
USER_SCRIPT = """
import sys, tempfile, time, traceback, torch
from pyspark.sql import SparkSession
from spark_estimator import Store, TorchEstimator, distributed

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.calls = torch.nn.Linear(3, 1), 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            print("forward call", self.calls)
        return self.linear(x)

class Loss(torch.nn.Module):
    def __init__(self, fail_at=None):
        super().__init__()
        self.fail_at, self.calls = fail_at, 0

    def forward(self, output, label):
        self.calls += 1
        if self.calls == self.fail_at and distributed.rank() == 0:
            raise ValueError("the loss failed in epoch 2")
        return torch.nn.functional.mse_loss(output, label)

spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
rows = [([i / 64, 1.0, -1.0], i / 32) for i in range(64)]
df = spark.createDataFrame(rows, "x array<double>, y double")

def fit(loss, lr_scaling="none"):
    net = Net()
    return TorchEstimator(
        model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.01), loss=loss,
        feature_cols=["x"], label_cols=["y"], batch_size=16, epochs=4, num_proc=2,
        use_gpu=False, store=Store.create(tempfile.mkdtemp()), lr_scaling=lr_scaling,
    ).fit(df)

model = fit(Loss(), lr_scaling="linear")
print("=== fitted ===", file=sys.stderr, flush=True)
print("transformed", len(model.transform(df.limit(10)).collect()), flush=True)
print("=== the failing fit ===", file=sys.stderr, flush=True)
try:
    fit(Loss(fail_at=5))  # 2 steps an epoch on each rank
except Exception:  # shown as Python shows it
    traceback.print_exc()
    spark.stop()  # at once: the failed job's other task has ended already
    print("=== stopped ===", file=sys.stderr, flush=True)
    time.sleep(3)  # anything Spark would still print
    sys.exit(1)
"""


@pytest.fixture(scope="module")
def user_view(tmp_path_factory) -> tuple[str, str]:
    """stdout and stderr of USER_SCRIPT, stderr cut at the failing fit: (plain, failed)."""
    done = run_user_script(tmp_path_factory.mktemp("user"), USER_SCRIPT)
    assert done.returncode == 1, done.stderr[-3000:]
    plain, _, failed = done.stderr.partition("=== the failing fit ===")
    return done.stdout + plain, failed


def test_a_fit_shows_each_line_of_the_ranks_once_as_the_driver_logs_it(user_view):
    plain, _ = user_view
    # the tasks' own stdout is this terminal on a local master: only the driver's copy shows
    lines = [line for frame in plain.split("\r") for line in frame.splitlines()]
    printed = [line.strip() for line in lines if "forward call" in line]
    assert sorted(printed) == ["[rank 0] forward call 3", "[rank 1] forward call 3"], printed


def test_a_transform_after_a_fit_shows_its_result_and_no_traceback(user_view):
    """Nothing of a fit's leaves a Python worker that a later limited transform's tasks
    reuse broken (pyspark's own BrokenPipeError lines: docs/troubleshooting.md)."""
    plain, _ = user_view
    assert "transformed 10" in plain
    assert "Traceback" not in plain and "BrokenPipeError" not in plain, plain[-3000:]


def test_a_failed_fit_shows_our_error_once_and_not_the_executors(user_view):
    _, failed = user_view
    assert failed.count("TrainingError: LossFailed") == 1, failed
    assert "ValueError: the loss failed in epoch 2" in failed
    # Spark's log lines of the failed barrier tasks and its Java error are not repeated
    for spark_line in ("ERROR Executor", "TaskSetManager", "Py4JJavaError", "PythonException"):
        assert spark_line not in failed, failed


def test_a_fit_draws_no_stage_bars_of_spark_and_shows_its_scaled_learning_rate(user_view):
    """Spark's console progress (on in a Python program) is off while a fit runs; the
    learning rate lr_scaling changed is printed with Python's default logging."""
    plain, _ = user_view
    fitting = plain.partition("=== fitted ===")[0]
    assert "[Stage" not in fitting, fitting[-3000:]
    line = (
        "learning rate 0.02 on each of 2 ranks: the optimizer's 0.01 x 2 (lr_scaling='linear', "
        "as Horovod's estimator)"
    )
    assert fitting.count(line) == 1, fitting[-3000:]


def test_spark_stop_right_after_a_failed_fit_prints_no_java_stack_trace(user_view):
    """The fit raises once the failed job's other tasks have ended, so stopping the session
    at once tears down no block a task still holds (``Block broadcast_N does not exist``)."""
    _, failed = user_view
    assert "=== stopped ===" in failed
    assert "\tat org.apache" not in failed and "ERROR" not in failed, failed[-3000:]


def test_a_failed_fit_shows_no_cpp_frames_of_the_rank_left_waiting(user_view):
    """Rank 1 fails after rank 0 (in its allreduce): torch logs no failed call to a store
    that went away, with its C++ frames, after our error."""
    _, failed = user_view
    assert "frame #" not in failed and "Exception raised from" not in failed, failed
    assert "TCPStore" not in failed, failed
