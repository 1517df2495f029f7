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
