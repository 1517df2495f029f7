"""Training throughput of ``fit`` on CPU with 1, 2, 4 and 8 processes: scaling efficiency.

A hand-run benchmark, not a test. The job: 1M rows x 32 float32 features + a float32 label
(see bench_common.py), MLP 32-256-256-1, MSE, SGD(lr=0.01), 2 epochs, CPU training
(``use_gpu=False``) on ``local[P x C]``, where P is the largest process count measured and
C is ``--task-cpus``, set as ``spark.task.cpus``: each training process gets C cores, and the
library sets its torch threads to C (``torch.set_num_threads(TaskContext.cpus())`` in
``worker/comm/device.py``). Process counts that need more cores than the machine has are
skipped (``--procs`` chooses the counts).

Two batch settings (``--batch-mode``, default both):

- ``global``: the job's global batch of 512 split over the processes (512 / n each), so
  every process count takes the same optimizer steps (strong scaling);
- ``per-process``: 512 rows per process (a global batch of 512 x n; weak scaling, how
  Horovod-style throughput is usually quoted).

For each count n and setting: ``materialize(df)`` (untimed: each n writes its own files,
4 per process), then ``--repeats`` fits that reuse the dataset. Throughput(n) is the rows
trained per second of the ranks' training loop: rows x epochs / the longest rank's
``seconds`` in ``runs/<run_id>/ranks.json`` (from the end of the rank's setup to the end of
its loop); the fit's total wall time (validation, launch, rendezvous and the result
included, materialization not) is shown next to it. Efficiency(n) = throughput(n) /
(n x throughput(1)). Before the timed fits, one untimed fit of 4,096 rows on the largest
count starts Spark's Python workers.

Target: efficiency >= 0.8 at 8 processes. Results are printed and written to
``benchmarks/results/scaling.md`` with a plot, ``benchmarks/results/scaling.png`` (a run
smaller than the full job writes both to a temporary folder; ``--no-record``: neither).

Run from the repository root (on this 2-core machine only 1 and 2 processes are measured)::

    .venv/bin/python benchmarks/scaling.py [--procs 1,2,4,8] [--task-cpus 1]
    .venv/bin/python benchmarks/scaling.py --rows 50000 --epochs 1 --repeats 1  # quick
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402

TARGET, TARGET_PROCS = 0.8, 8
HEADER = """\
# Scaling (benchmarks/scaling.py)

Training throughput (rows/s of the ranks' training loop, from `ranks.json`) of `fit` on
CPU with 1, 2, 4, 8 processes (`spark.task.cpus` cores and torch threads each; counts
needing more cores than the machine has are skipped), 1M rows x 32 float32 features +
label, MLP 32-256-256-1, SGD, 2 epochs; the global batch of 512 split over the processes
(strong scaling) and 512 rows per process (weak scaling). Efficiency(n) = throughput(n) /
(n x throughput(1)); target >= 0.8 at 8 processes. Plot: [scaling.png](scaling.png).

    .venv/bin/python benchmarks/scaling.py [--procs 1,2,4,8] [--task-cpus C] [--rows N]

Each run replaces the section of its stack below and keeps the others.
"""
MODES = {"global": "global batch 512", "per-process": "512 per process"}


def plot(results: dict, cores: int, task_cpus: int) -> bytes:
    """A PNG: throughput against processes (ideal dashed) and efficiency, per batch mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, points in results.items():
        procs = sorted(points)
        rates = [points[n]["rate"] for n in procs]
        base = points[1]["rate"] if 1 in points else None
        (line,) = left.plot(procs, rates, "o-", label=MODES[mode])
        if base:
            left.plot(procs, [n * base for n in procs], "--", color=line.get_color(), alpha=0.5)
            efficiency = [points[n]["rate"] / (n * base) for n in procs]
            right.plot(procs, efficiency, "o-", color=line.get_color(), label=MODES[mode])
    left.set(xlabel="training processes", ylabel="rows/s (training loop)", xticks=[1, 2, 4, 8])
    left.set_ylim(bottom=0)
    left.set_title("throughput (dashed: ideal)")
    left.legend()
    right.axhline(TARGET, color="grey", linestyle=":", label=f"target >= {TARGET}")
    right.set(xlabel="training processes", ylabel="efficiency", xticks=[1, 2, 4, 8])
    right.set_ylim(0, 1.2)
    right.set_title("efficiency = thr(n) / (n x thr(1))")
    right.legend()
    fig.suptitle(f"spark-estimator fit on CPU, {task_cpus} core(s) per process, {cores} cores")
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", default="1,2,4,8", help="process counts, comma-separated")
    parser.add_argument("--task-cpus", type=int, default=1, help="spark.task.cpus")
    parser.add_argument("--batch-mode", choices=("global", "per-process", "both"), default="both")
    parser.add_argument("--rows", type=int, default=bc.FULL_ROWS)
    parser.add_argument("--epochs", type=int, default=bc.FULL_EPOCHS)
    parser.add_argument("--repeats", type=int, default=2, help="timed fits per count and mode")
    parser.add_argument("--data", default=str(bc.DATA), help="folder of the generated Parquet")
    parser.add_argument("--store-dir", default=tempfile.gettempdir(), help="where stores go")
    parser.add_argument("--quiet-timeout", type=float, default=60.0)
    bc.add_record_args(parser)
    args = parser.parse_args()

    cores = os.cpu_count() or 1
    wanted = sorted({int(p) for p in args.procs.split(",")})
    procs = [n for n in wanted if n * args.task_cpus <= cores]
    skipped = [n for n in wanted if n not in procs]
    if not procs:
        parser.error(f"no process count of {wanted} fits {cores} cores at {args.task_cpus} each")
    if skipped:
        print(f"skipping {skipped} processes: more than {cores} cores at {args.task_cpus} each")
    modes = list(MODES) if args.batch_mode == "both" else [args.batch_mode]
    master = f"local[{max(procs) * args.task_cpus}]"

    from spark_estimator import Store

    path = bc.dataset(args.rows, Path(args.data))
    spark = bc.spark_session(master, {"spark.task.cpus": args.task_cpus})
    df = bc.frame(spark, path)
    env = bc.machine()
    print(f"{args.rows:,} rows, {args.epochs} epochs, {master}; {env['cpu']}", flush=True)
    folder = tempfile.mkdtemp(prefix="scaling-store-", dir=args.store_dir)
    results: dict[str, dict[int, dict]] = {mode: {} for mode in modes}
    contended = 0
    try:
        store = Store.create(folder)
        start = time.perf_counter()
        bc.estimator(store, num_proc=max(procs), batch_size=64, epochs=1).fit(df.limit(4096))
        print(f"warm-up fit (4,096 rows): {time.perf_counter() - start:.1f} s", flush=True)
        for n in procs:
            for mode in modes:
                batch = bc.GLOBAL_BATCH if mode == "per-process" else bc.GLOBAL_BATCH // n
                if n == 1 and mode != modes[0]:  # the same fit as the first mode's
                    results[mode][1] = results[modes[0]][1]
                    continue
                est = bc.estimator(store, num_proc=n, batch_size=batch, epochs=args.epochs)
                est.materialize(df)
                runs = []
                for _ in range(args.repeats):
                    contended += not bc.wait_quiet(args.quiet_timeout)
                    fit = bc.timed_fit(est, df, store)
                    if not fit["times"].get("reused", True):
                        print("note: this fit wrote its dataset again (expected to reuse it)")
                    runs.append({"train_s": fit["train_s"], "total": fit["total"]})
                best = min(runs, key=lambda r: r["train_s"])
                samples = args.rows * args.epochs
                results[mode][n] = {
                    **best,
                    "batch": batch,
                    "rate": samples / best["train_s"],
                    "fit_rate": samples / min(r["total"] for r in runs),
                }
                print(
                    f"{n} process(es), batch {batch} each: {results[mode][n]['rate']:,.0f} rows/s "
                    f"training ({best['train_s']:.2f} s), fit total {best['total']:.2f} s",
                    flush=True,
                )
    finally:
        spark.stop()
        shutil.rmtree(folder, ignore_errors=True)

    full = args.rows >= bc.FULL_ROWS and args.epochs == bc.FULL_EPOCHS
    lines = [
        f"## {env['date']}, stack `{env['venv']}`",
        "",
        *bc.machine_lines(env),
        f"- Job: {args.rows:,} rows, {args.epochs} epoch(s) "
        f"({'the full job' if full else 'SMALLER THAN THE FULL JOB'}); `{master}`, "
        f"spark.task.cpus {args.task_cpus} (torch threads per process); best of "
        f"{args.repeats} fit(s) per row, {contended} started while other processes kept the "
        f"CPUs busy" + (f"; skipped {skipped} processes (too few cores)" if skipped else ""),
        "",
        "| batch | processes | batch per process | training rows/s | efficiency | "
        "training s | fit total s (data cached) | fit rows/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts = []
    for mode, points in results.items():
        base = points.get(1, {}).get("rate")
        for n, p in sorted(points.items()):
            eff = p["rate"] / (n * base) if base else None
            lines.append(
                f"| {MODES[mode]} | {n} | {p['batch']} | {p['rate']:,.0f} | "
                f"{'n/a' if eff is None else f'{eff:.2f}'} | {p['train_s']:.2f} | "
                f"{p['total']:.2f} | {p['fit_rate']:,.0f} |"
            )
        top = max(points)
        if base and top > 1:
            eff = points[top]["rate"] / (top * base)
            if top == TARGET_PROCS:
                verdict = f"target >= {TARGET}: {'met' if eff >= TARGET else 'MISSED'}"
            else:
                verdict = f"the target, >= {TARGET}, is at {TARGET_PROCS}: not measured here"
            verdicts.append(
                f"- {MODES[mode]}: efficiency at {top} processes **{eff:.2f}** ({verdict})"
            )
    lines += ["", *verdicts, "", "![scaling](scaling.png)"]
    section = "\n".join(lines) + "\n"
    print("\n" + section)
    png = plot(results, cores, args.task_cpus)
    bc.record(args, "scaling", HEADER, section, env["venv"], full, {"scaling.png": png})


if __name__ == "__main__":
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    main()
