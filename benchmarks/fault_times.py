"""How long a fit takes to report or survive each fault (docs/reliability.md's table).

Usage: python benchmarks/fault_times.py [--repeats N]

Each scenario fits a small dropout model (4 epochs of 200 rows, 2 processes) with a fault
injected by ``tests/faults.py``, and times ``fit`` from the call to its exception or
result, next to the same fit without a fault:

- raise: rank 1 raises in epoch 2 (local[4]); the driver raises TrainingError.
- hang: rank 1 sleeps in epoch 2, ``collective_timeout=3`` (local[4]); resumes.
- kill: rank 1's Python process is SIGKILLed in epoch 3 (local-cluster[2,1,1024]); resumes.
- kill-executor: its executor JVM is SIGKILLed instead; resumes on a new executor.

Writes ``benchmarks/results/faults.md`` with the machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["PYSPARK_PYTHON"] = sys.executable

import cloudpickle  # noqa: E402
from pyspark import cloudpickle as pyspark_cloudpickle  # noqa: E402

from spark_estimator import Store, TrainingError  # noqa: E402
from tests import conftest, faults, test_reliability  # noqa: E402

for module in (conftest, faults, test_reliability):
    cloudpickle.register_pickle_by_value(module)
    pyspark_cloudpickle.register_pickle_by_value(module)

SCENARIOS = [  # (name, master, fault action, epoch, extra params)
    ("raise", conftest.LOCAL, "raise", 2, {}),
    ("hang", conftest.LOCAL, "hang", 2, {"collective_timeout": 3.0}),
    ("kill", conftest.CLUSTER, "kill", 3, {}),
    ("kill-executor", conftest.CLUSTER, "kill-executor", 3, {}),
]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1] for line in f if line.startswith("model name")]
        return names[0].strip()
    except (OSError, IndexError):
        return platform.processor() or "unknown CPU"


def timed_fit(spark, tmp: Path, action: str | None, epoch: int, params: dict) -> tuple:
    store = Store.create(str(tmp / "store"))
    df = spark.createDataFrame(conftest.regression_rows(), "x array<double>, y double, id long")
    df.count()
    callbacks = []
    if action:
        once = action != "raise"
        callbacks = [faults.Fault(action, 1, epoch, tmp / f"marker-{time.time()}", once=once)]
    est = test_reliability.momentum_estimator(store, callbacks=callbacks, **params)
    started = time.monotonic()
    try:
        model = est.fit(df)
        outcome = f"resumed from epoch {model.getTrainingSummary()['resumed_from_epoch']}"
    except TrainingError as e:
        outcome = f"TrainingError from rank {e.rank}"
    return time.monotonic() - started, outcome


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for name, master, action, epoch, params in SCENARIOS:
        spark = conftest.spark_session(master)
        with tempfile.TemporaryDirectory() as tmp:
            timed_fit(spark, Path(tmp), None, epoch, params)  # warm up workers and the cache
            clean, _ = timed_fit(spark, Path(tmp), None, epoch, params)
            runs = [timed_fit(spark, Path(tmp), action, epoch, params) for _ in range(args.repeats)]
        times = ", ".join(f"{t:.1f}" for t, _ in runs)
        rows.append((name, master, times, f"{clean:.1f}", runs[-1][1]))
        print(rows[-1], flush=True)
    for session in conftest._current.values():
        session.stop()

    machine = f"{platform.node()}: {os.cpu_count()} cores, {cpu_model()}"
    lines = [
        "# Fault times",
        "",
        f"`python benchmarks/fault_times.py` on {time.strftime('%Y-%m-%d')}, {machine}, "
        f"Python {platform.python_version()}. Seconds from `fit` to its exception or result.",
        "",
        "| fault | master | with the fault (s) | same fit, no fault (s) | outcome |",
        "|---|---|---|---|---|",
        *[f"| {' | '.join(r)} |" for r in rows],
        "",
    ]
    out = ROOT / "benchmarks" / "results" / "faults.md"
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
