"""The Python the tasks run: the driver's on a local master, checked on a cluster."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import make_estimator, regression_rows, spark_session, stop_session

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = "/usr/bin/python3"  # a Python without torch (nor this venv's packages)

FIT = """
import torch
from pyspark.sql import SparkSession
from spark_estimator import Store, TorchEstimator

spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
spark.sparkContext.setLogLevel("ERROR")
rows = [([float(i), 1.0, -float(i)], 2.0 * i) for i in range(64)]
df = spark.createDataFrame(rows, "x array<double>, y double")
net = torch.nn.Linear(3, 1)
model = TorchEstimator(
    model=net, optimizer=torch.optim.SGD(net.parameters(), lr=1e-3), loss=torch.nn.MSELoss(),
    feature_cols=["x"], label_cols=["y"], batch_size=16, epochs=1, num_proc=2,
    store=Store.create({store!r}), verbose=False,
).fit(df)
print("fitted", model.transform(df).count())
"""


def _without_the_venv() -> dict[str, str]:
    """This environment as a user's shell has it without activating the venv: its bin not on
    PATH, no VIRTUAL_ENV, no PYSPARK_PYTHON (tests/conftest.py sets it for the suite)."""
    venv_bin = str(Path(sys.executable).parent)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "VIRTUAL_ENV")
    }
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != venv_bin)
    env["PYTHONPATH"] = str(ROOT)  # this checkout's spark_estimator, as the editable install
    return env


def test_a_fit_run_by_the_venvs_python_without_activating_it_trains_on_a_local_master(tmp_path):
    env = _without_the_venv()
    python3 = shutil.which("python3", path=env["PATH"])
    # Spark's default, python3 from the PATH, is another Python, which lacks torch
    assert python3 and Path(python3).resolve() != Path(sys.executable).resolve()
    assert subprocess.run([python3, "-c", "import torch"], env=env, capture_output=True).returncode

    script = tmp_path / "fit.py"
    script.write_text(FIT.format(store=str(tmp_path / "store")))
    done = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fitted 64" in done.stdout
    assert "ModuleNotFoundError" not in done.stderr


@pytest.mark.cluster
@pytest.mark.skipif(not os.path.exists(SYSTEM_PYTHON), reason="needs a second Python")
def test_a_cluster_whose_tasks_python_lacks_torch_fails_before_training_naming_it(store):
    master = "local-cluster[1,1,1024]"
    spark = spark_session(master, **{"spark.pyspark.python": SYSTEM_PYTHON})
    try:
        df = spark.createDataFrame(regression_rows(40), "x array<double>, y double, id long")
        with pytest.raises(RuntimeError) as failure:
            make_estimator(store=store, num_proc=1).fit(df)
    finally:
        stop_session(master)
    message = str(failure.value)
    assert message.startswith("spark.pyspark.python: ")
    assert SYSTEM_PYTHON in message and "No module named 'torch'" in message
    assert "PYSPARK_PYTHON" in message
    assert len(message.splitlines()) <= 3  # one error, not the executors' tracebacks
    error = failure.value  # nothing chained: Python prints this one error
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)
    assert not store.exists(store.datasets) and not store.exists(store.runs)  # no job wrote
