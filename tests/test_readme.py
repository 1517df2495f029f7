"""README.md's Example runs as printed: copied from the README, run as a Python program."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from spark_estimator import Store

README = Path(__file__).resolve().parents[1] / "README.md"


def example_code() -> str:
    """The first ```python block of README.md's "## Example" section."""
    section = README.read_text().split("\n## Example\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run_example(folder: Path) -> float:
    """The example run in ``folder`` (its temporary files under ``folder/tmp``); its accuracy."""
    (folder / "tmp").mkdir()
    # As with the virtual environment active: its python3 first on PATH (Spark starts the
    # tasks' Python as python3), no PYSPARK_* variables chosen for it.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env = dict(os.environ, PATH=path, TMPDIR=str(folder / "tmp"))
    for name in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "SPARK_CONF_DIR"):
        env.pop(name, None)
    done = subprocess.run(
        ["python3", "../example.py"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return float(re.search(r"^accuracy: ([0-9.]+)$", done.stdout, re.M).group(1))


def test_readme_example_runs_as_printed_the_same_each_time_and_writes_only_to_a_temporary_folder(
    tmp_path,
):
    code = example_code()
    ast.parse(code)  # a syntax error fails here, with its line
    (tmp_path / "example.py").write_text(code)
    runs = [tmp_path / "first", tmp_path / "second"]
    accuracies = []
    for folder in runs:
        folder.mkdir()
        accuracies.append(run_example(folder))
    assert accuracies[0] >= 0.9  # iris: a linear model alone gets about 0.97
    assert accuracies[0] == accuracies[1]  # seeded: the same model each run
    for folder in runs:
        assert sorted(p.name for p in folder.iterdir()) == ["tmp"]  # nothing in the work folder
        (work,) = (folder / "tmp").glob("iris-*")
        assert (work / "iris_model" / "weights.pt").is_file()
        assert list(Path(Store(str(work / "store")).runs).iterdir())  # the run is in the store
