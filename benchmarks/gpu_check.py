"""Every GPU check of the project in one command, with one table of results at the end.

On a machine with a CUDA GPU and the project installed (or the shared GPU runtime, see
``../shared/gpu/README.md``), from the repository root:

    python benchmarks/gpu_check.py              # all checks, one after the other
    python benchmarks/gpu_check.py --list       # their names
    python benchmarks/gpu_check.py gpu-tests loop-cuda   # some of them (a lent GPU machine
                                                # takes at most 10 minutes a command)

The checks: every test marked ``gpu`` (``pytest -m gpu tests``), ``gpu_fit.py`` for both
model sizes of its targets (MLP 32-4096x3-1 and 32-256x2-1), eager and with ``--compile``,
``loop_overhead.py --device cuda``, and ``image_gpu.py`` (``image-gpu``: an image fit on
the GPU, the small CNN and resnet18, with ``decode_fn``, the default decoding and
``decode_device="cuda"``, against a hand ``DataLoader`` loop; it needs torchvision, and
simplejpeg for the default decoding: see its docstring for the wheel the lent machine
lacks; sized for under 4 minutes there). Each benchmark records its section in
``benchmarks/results/`` as it always does; the table here gives, per check, its exit status,
its seconds and its headline figures (the bold ratios the benchmark prints). Exits 1 if any
check failed, 2 without a CUDA GPU (``--dry-run`` prints the commands instead).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_FIT = "benchmarks/gpu_fit.py"
SMALL = ["--hidden", "256", "--depth", "2"]  # gpu_fit's second target size

# name -> the command's arguments after the Python interpreter
CHECKS = {
    "gpu-tests": ["-m", "pytest", "-m", "gpu", "tests", "-q", "-p", "no:cacheprovider"],
    "fit-large": [GPU_FIT],
    "fit-large-compile": [GPU_FIT, "--compile"],
    "fit-small": [GPU_FIT, *SMALL],
    "fit-small-compile": [GPU_FIT, *SMALL, "--compile"],
    "loop-cuda": ["benchmarks/loop_overhead.py", "--device", "cuda"],
    "image-gpu": ["benchmarks/image_gpu.py"],
}


def headline(name: str, output: str) -> str:
    """What a check's output says in brief: pytest's summary line, or the benchmark's bold
    figures (its ratios against the baseline), each line stripped of its table pipes."""
    lines = output.splitlines()
    if name == "gpu-tests":
        summary = [line.strip("= ") for line in lines if re.search(r"\d+ (passed|failed)", line)]
        return summary[-1] if summary else "no test summary"
    bold = [
        " ".join(part.strip() for part in line.split("|") if part.strip())
        for line in lines
        if "**" in line
    ]
    return "; ".join(bold) if bold else "no figures printed"


def run_check(name: str, python: str) -> tuple[int, float, str]:
    """Run check ``name`` from the repository root, its output shown as it comes; (exit
    status, seconds, headline)."""
    started = time.monotonic()
    process = subprocess.Popen(
        [python, *CHECKS[name]],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = []
    for line in process.stdout:
        sys.stdout.write(line)
        output.append(line)
    status = process.wait()
    return status, time.monotonic() - started, headline(name, "".join(output))


def table(rows: list[tuple[str, int, float, str]]) -> str:
    lines = ["| check | exit | seconds | result |", "|---|---:|---:|---|"]
    lines += [
        f"| {name} | {status} | {seconds:.0f} | {result} |"
        for name, status, seconds, result in rows
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "checks", nargs="*", help=f"which checks (default: all): {', '.join(CHECKS)}"
    )
    parser.add_argument("--list", action="store_true", help="print the checks' names and commands")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    unknown = [name for name in args.checks if name not in CHECKS]
    if unknown:
        parser.error(f"unknown check(s) {unknown}; the checks are {list(CHECKS)}")
    chosen = args.checks or list(CHECKS)
    if args.list or args.dry_run:
        for name in chosen:
            print(f"{name}: {' '.join(['python', *CHECKS[name]])}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_check.py: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr
        )
        return 2
    rows = [(name, *run_check(name, sys.executable)) for name in chosen]
    print(f"\n{torch.cuda.get_device_name(0)}, torch {torch.__version__}\n\n{table(rows)}")
    return 1 if any(status != 0 for _, status, _, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
