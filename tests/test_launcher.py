"""spark-estimator-run (python -m spark_estimator.launcher): a script on N Spark tasks, its
ranks' output on the terminal by rank and stream, the exit code."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
from spark_estimator.worker.comm.rendezvous import init_default_group

init_default_group()
try:
    import launcher_deps  # in the zip that --py-files gives, where a test gives it
    print("from --py-files:", launcher_deps.VALUE, file=sys.stderr)
except ImportError:
    pass
total = torch.tensor([float(dist.get_rank())])
dist.all_reduce(total)
print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "sum", total.item(), sys.argv[1:])
print("setting", os.environ.get("MY_SETTING"), file=sys.stderr)
if dist.get_rank() == 1 and "--fail" in sys.argv:
    raise ValueError("boom on rank 1")
"""


def launch(tmp_path, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "spark_estimator.launcher", *args]
    command = [str(script) if a == "train.py" else a for a in command]
    return subprocess.run(
        command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )


def test_the_launcher_runs_a_script_and_shows_each_ranks_lines_by_stream(tmp_path):
    deps = tmp_path / "elsewhere" / "deps.zip"
    deps.parent.mkdir()
    with zipfile.ZipFile(deps, "w") as z:
        z.writestr("launcher_deps/__init__.py", "VALUE = 'zipped'\n")
    done = launch(
        tmp_path, "-np", "2", "--master", "local[2]", "--conf", "spark.ui.enabled=false",
        "--env", "MY_SETTING=on", "--verbose", "2", "--py-files", str(deps),
        "train.py", "--lr", "0.1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "GPU" not in done.stderr and "Warning" not in done.stderr  # a CPU run by default
    out = done.stdout.splitlines()
    assert "[rank 0] rank 0 of 2 sum 1.0 ['--lr', '0.1']" in out
    assert "[rank 1] rank 1 of 2 sum 1.0 ['--lr', '0.1']" in out
    err = done.stderr.splitlines()
    assert "[rank 0] setting on" in err and "[rank 1] setting on" in err
    assert "[rank 0] from --py-files: zipped" in err and "[rank 1] from --py-files: zipped" in err
    assert any(line.startswith("[rank 1] spark-estimator: rank 1 of 2 on ") for line in err)


def test_a_failing_rank_makes_the_launcher_exit_non_zero_with_its_traceback(tmp_path):
    done = launch(tmp_path, "-np", "2", "--master", "local[2]", "train.py", "--fail")
    assert done.returncode == 1
    assert "spark-estimator-run: rank 1 failed: ValueError: boom on rank 1" in done.stderr
    assert "Traceback (most recent call last)" in done.stderr
    assert 'train.py", line 18' in done.stderr


def test_bad_arguments_exit_2_before_any_spark(tmp_path):
    done = launch(tmp_path, "--master", "local[2]", "train.py")  # no -np
    assert done.returncode == 2 and "-np" in done.stderr
    assert "SparkContext" not in done.stderr
    done = launch(tmp_path, "-np", "1", "--py-files", "a.py,missing.zip", "train.py")
    assert done.returncode == 2
    assert "spark-estimator-run: --py-files: no such file: a.py, missing.zip" in done.stderr
    assert "Spark" not in done.stderr


def test_setup_declares_the_console_script():
    from spark_estimator.launcher import main

    setup = (ROOT / "setup.py").read_text()
    assert '"spark-estimator-run = spark_estimator.launcher:main"' in setup
    assert callable(main)


def test_the_gpu_flag_requires_a_gpu_per_rank_and_exits_2_naming_it(tmp_path):
    done = launch(
        tmp_path, "-np", "2", "--master", "local[2]", "--gpu",
        "--conf", "spark.executor.resource.gpu.amount=1", "--no-stage-level-scheduling",
        "train.py",
    )  # fmt: skip
    assert done.returncode == 2
    assert "spark-estimator-run: use_gpu: True " in done.stderr
    # executors with GPUs, tasks without: the profile that would give them one is off
    assert "does not apply here: switched off by stage_level_scheduling=False" in done.stderr
    assert "[rank" not in done.stderr  # refused before the job
