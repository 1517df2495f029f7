"""benchmarks/gpu_check.py: the one command that runs every GPU check and tabulates them."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_gpu_check_is_run_gpu_tests_both_fit_sizes_eager_and_compiled_and_the_cuda_loop():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, check=True
    )
    commands = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert commands["gpu-tests"].startswith("python -m pytest -m gpu tests")
    fits = [c for c in commands.values() if "benchmarks/gpu_fit.py" in c]
    assert sorted(("--hidden 256" in c, "--compile" in c) for c in fits) == [
        (False, False),
        (False, True),
        (True, False),
        (True, True),
    ]
    assert commands["loop-cuda"] == "python benchmarks/loop_overhead.py --device cuda"
    for command in commands.values():  # each names a file of the repository
        script = command.split()[1] if command.split()[1] != "-m" else None
        assert script is None or (ROOT / script).is_file()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_it_says_so_and_exits_2():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr


def test_an_unknown_check_is_refused_naming_the_checks():
    done = subprocess.run([sys.executable, str(SCRIPT), "fit-huge"], capture_output=True, text=True)
    assert done.returncode == 2 and "unknown check(s) ['fit-huge']" in done.stderr


def test_the_table_gives_each_checks_headline():
    module = gpu_check()
    fit = "x\n- Ours (training loop) / baseline: **0.97** (target >= 0.95: met); whole fit: 0.9\n"
    loop = "| Linear(32, 1) | 900 | 880 | **0.98** (0.97) | 500 | 0.56 |\n"
    assert module.headline("fit-large", fit).startswith(
        "- Ours (training loop) / baseline: **0.97**"
    )
    assert module.headline("loop-cuda", loop) == "Linear(32, 1) 900 880 **0.98** (0.97) 500 0.56"
    assert (
        module.headline("gpu-tests", "...\n===== 7 passed in 174.2s =====\n")
        == "7 passed in 174.2s"
    )
    assert module.headline("fit-small", "Traceback ...") == "no figures printed"
    rows = [("gpu-tests", 0, 174.2, "7 passed"), ("fit-large", 1, 60.0, "no figures printed")]
    assert module.table(rows).splitlines()[2:] == [
        "| gpu-tests | 0 | 174 | 7 passed |",
        "| fit-large | 1 | 60 | no figures printed |",
    ]
