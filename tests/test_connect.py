"""fit, transform, fit_on_parquet, save/load, an MLflow Model, run(fn) and OptunaSearch on a
real local Spark Connect session, in a subprocess (tests/connect_job.py): a local Connect
server cannot share a process with the classic local[4] session of the other tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyspark
import pytest

pytestmark = pytest.mark.skipif(
    int(pyspark.__version__.split(".")[0]) < 4,
    reason="a local Spark Connect server (remote('local[2]')) needs pyspark 4",
)
JOB = Path(__file__).with_name("connect_job.py")


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    scratch = tmp_path_factory.mktemp("connect")
    proc = subprocess.run(
        [sys.executable, str(JOB), str(scratch)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=JOB.parents[1],
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_the_session_is_connect_and_its_slots_are_counted(result):
    assert result["is_connect"] is True
    assert result["slots"] == 2  # local[2], from the server's spark.master


def test_fit_learns_the_weights_and_transform_predicts(result):
    assert result["weight"] == pytest.approx([1.5, -2.0, 0.7], abs=0.05)
    assert result["bias"] == pytest.approx(0.5, abs=0.05)
    assert result["final_loss"] < 1e-3
    assert result["rows"] == 200
    assert result["max_error"] < 0.1


def test_the_model_logs_to_mlflow_with_a_connect_dataframe_as_its_example(result):
    pytest.importorskip("mlflow")
    logged = result["mlflow"]
    assert logged["example"] == ["x"] and logged["example_rows"] == 2
    assert logged["max_difference"] < 1e-6  # pyfunc's predict == transform
    assert logged["stage_loads"] is True


def test_too_many_processes_fail_on_the_driver_before_any_job(result):
    assert result["too_many_procs"].startswith("ValueError: num_proc: 3 training processes")
    assert result["datasets_after_error"] is False


def test_a_delta_tables_folder_read_as_parquet_is_refused_before_any_job(result):
    if result["delta_folder"] is None:
        pytest.skip("deltalake is not installed")
    assert result["delta_folder"].startswith("ValueError: ")
    assert "Delta table" in result["delta_folder"] and "at version 0" in result["delta_folder"]
    assert not result["datasets_after_error"]


def test_materialized_data_is_reused_for_the_same_plan_only(result):
    assert result["reused"] is True
    assert result["reuse_wrote_nothing"] is True  # no file or folder written or touched
    assert result["other_plan_other_dataset"] is True
    assert result["fit_on_parquet_epochs"] == 1


def test_save_and_load(result):
    assert result["loaded_equal"] is True


def test_run_fn(result):
    assert result["run"] == [2.0, 2.0]  # (0 + 0.5) + (1 + 0.5), summed on both ranks


def test_dataset_keys(result):
    keys = result["fingerprints"]
    assert keys["same_plan_again"] and keys["same_plan_other_session"]
    assert keys["filtered_differs"] and keys["other_rows_differ"]
    assert keys["files_listed"] >= 1 and keys["files_other_session"]
    assert keys["rewritten_files_differ"]
    assert keys["view_is_session_scoped"]


def test_an_optuna_search_runs_its_trials_two_at_once_as_fits_do(result):
    pytest.importorskip("optuna")
    assert result["tuning"] == {"states": ["COMPLETE"] * 3, "at_once": 2, "transformed": 200}
