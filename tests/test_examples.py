"""The demo runs as a spark-submit job and reaches the promised accuracy."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_digits_demo_under_spark_submit(tmp_path):
    spark_submit = Path(sys.executable).parent / "spark-submit"
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    done = subprocess.run(
        [str(spark_submit), "examples/digits_classifier.py", "--store", str(tmp_path / "store")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    accuracy = float(re.search(r"held-out accuracy: ([0-9.]+)", done.stdout).group(1))
    assert accuracy >= 0.9
    assert re.search(r"^\s+10\s+\d", done.stdout, re.M)  # ten epochs of history printed
    assert (tmp_path / "store" / "models" / "digits" / "objects.pkl").exists()


def test_horovod_style_script_runs_as_plain_python_and_learns():
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    env.pop("SPARK_MASTER", None)  # the script's own local[2] session
    done = subprocess.run(
        [sys.executable, "examples/horovod_style_digits.py", "--epochs", "10", "--num-proc", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    epochs = re.findall(r"^\s+(\d+)\s+([0-9.]+)\s+([0-9.]+)$", done.stdout, re.M)
    assert [int(e) for e, _, _ in epochs] == list(range(1, 11))
    accuracy = float(re.search(r"final test accuracy: ([0-9.]+)", done.stdout).group(1))
    assert accuracy == float(epochs[-1][2]) and accuracy > 0.9  # 0.969 when measured
