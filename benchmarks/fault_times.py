"""How long a fit takes to report or survive each fault (docs/reliability.md's table).

Usage: python benchmarks/fault_times.py [--repeats N]

Each scenario fits a small dropout model (4 epochs of 200 rows, 2 processes) with a fault
injected by ``tests/faults.py``, and times ``fit`` from the call to its exception or
result, next to the same fit without a fault:

- raise: rank 1 raises in epoch 2 (local[4]); the driver raises TrainingError.
- hang: rank 1 sleeps in epoch 2, ``collective_timeout=3`` (local[4]); resumes.
- kill: rank 1's Python process is SIGKILLed in epoch 3 (local-cluster[2,1,1024]); resumes.
- kill-executor: its executor JVM is SIGKILLed instead; resumes on a new executor.
- lose an executor for good: on a standalone cluster of 3 one-core Workers started here
  (tests/clusters.py), an elastic fit (``num_proc=3, min_num_proc=2``) whose rank 1 kills
  its Worker and executor after 2 batches of epoch 3; it goes on with 2 processes. Also
  reported: seconds from the kill to the resumed launch's first epoch, and the work
  repeated (the batches of the interrupted epoch done before the kill).

Writes ``benchmarks/results/faults.md`` with the machine.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["PYSPARK_PYTHON"] = sys.executable

import bench_common as bc  # noqa: E402

from spark_estimator import Store, TrainingError  # noqa: E402
from spark_estimator.callbacks import Callback  # noqa: E402
from tests import clusters, conftest, faults, test_reliability  # noqa: E402

for module in (conftest, faults, test_reliability):
    bc.by_value(module)

STANDALONE = "standalone, 3 Workers"  # started here: tests/clusters.py
ELASTIC = {"num_proc": 3, "min_num_proc": 2}
ROWS, BATCH = 200, 20  # conftest.regression_rows(), momentum_estimator's batch_size
SCENARIOS = [  # (name, master, fault action, epoch, extra params)
    ("raise", conftest.LOCAL, "raise", 2, {}),
    ("hang", conftest.LOCAL, "hang", 2, {"collective_timeout": 3.0}),
    ("kill", conftest.CLUSTER, "kill", 3, {}),
    ("kill-executor", conftest.CLUSTER, "kill-executor", 3, {}),
    ("lose an executor for good", STANDALONE, "kill-worker", 3, ELASTIC),
]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1] for line in f if line.startswith("model name")]
        return names[0].strip()
    except (OSError, IndexError):
        return platform.processor() or "unknown CPU"


class TrainingAgain(Callback):
    """Writes when an epoch first begins on fewer than ``procs`` processes (the launch
    after a loss trains again)."""

    def __init__(self, path: str, procs: int):
        self.path, self.procs = path, procs

    def on_epoch_begin(self, epoch, state):
        if state.world_size < self.procs and state.rank == 0 and not os.path.exists(self.path):
            Path(self.path).write_text(f"{time.time()} {epoch}")


def timed_fit(spark, tmp: Path, action: str | None, epoch: int, params: dict) -> tuple:
    store = Store.create(str(tmp / "store"))
    df = spark.createDataFrame(conftest.regression_rows(), "x array<double>, y double, id long")
    df.count()
    callbacks, marker, again = [], tmp / f"marker-{time.time()}", tmp / f"again-{time.time()}"
    if action:
        callbacks = [faults.Fault(action, 1, epoch, marker, once=action != "raise")]
    if "min_num_proc" in params:
        callbacks.append(TrainingAgain(str(again), params["num_proc"]))
    est = test_reliability.momentum_estimator(store, callbacks=callbacks, **params)
    started = time.monotonic()
    try:
        model = est.fit(df)
        outcome = f"resumed from epoch {model.getTrainingSummary()['resumed_from_epoch']}"
    except TrainingError as e:
        outcome = f"TrainingError from rank {e.rank}"
    if action and again.exists():
        procs = [h["num_proc"] for h in model.getHistory()]
        summary = model.getTrainingSummary()
        commit = summary["resumed_from_commit"]
        again_s = float(again.read_text().split()[0]) - marker.stat().st_mtime
        steps = math.ceil(math.ceil(ROWS / params["num_proc"]) / BATCH)
        # the kill comes in the forward pass of the epoch's 2nd batch: 1 batch was trained
        redone = 1 - (commit["step"] if commit else 0)
        where = f"its commit at step {commit['step']}" if commit else "its start"
        outcome = (
            f"processes per epoch {procs}; epoch {epoch} went on from {where}, training "
            f"again {again_s:.1f} s after the kill; work repeated: {redone} of its {steps} "
            "batches on 3 processes"
        )
    return time.monotonic() - started, outcome


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for name, master, action, epoch, params in SCENARIOS:
        cluster = clusters.StandaloneCluster(workers=3) if master == STANDALONE else None
        if cluster is not None:
            cluster.__enter__()
        spark = cluster.session() if cluster else conftest.spark_session(master)
        with tempfile.TemporaryDirectory() as tmp:
            timed_fit(spark, Path(tmp), None, epoch, params)  # warm up workers and the cache
            clean, _ = timed_fit(spark, Path(tmp), None, epoch, params)
            runs = []
            for _ in range(args.repeats):
                runs.append(timed_fit(spark, Path(tmp), action, epoch, params))
                if cluster is not None:  # a new Worker for the next repeat
                    cluster.start_worker()
                    cluster.session()
        if cluster is not None:
            cluster.__exit__(None, None, None)
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
