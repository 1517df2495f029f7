"""What a fit shows and leaves behind: the ranks' output on the driver, the progress bar,
TensorBoard event files, MLflow logging, and the last lines in a TrainingError."""

import logging
import subprocess
import sys

import pytest
import torch

from spark_estimator import TrainingError
from spark_estimator.callbacks import Callback
from tests.conftest import linear_net, make_estimator
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
    # where the last epoch's time went, over all ranks
    assert all(f"{kind}=" in err.splitlines()[-1] for kind in ("data", "comp", "comm"))

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
