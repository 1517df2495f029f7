"""Rows/s of ``TorchModel.transform`` against raw batched ``model(x)`` and a per-row UDF.

A hand-run benchmark, not a test. The model is the job's MLP 32-256-256-1 (untrained
weights from a fixed seed: inference costs the same); the rows are the job's 1M x 32
float32 features (see bench_common.py). Side by side in one run, best and median of
``--repeats`` timed passes after one untimed pass each:

(a) raw: one process, the rows already in memory as one float32 tensor, ``model(x[i:i+B])``
    under ``torch.no_grad()`` in slices of ``--batch-size`` rows (default 10,000, Spark's
    ``spark.sql.execution.arrow.maxRecordsPerBatch``), torch's default threads (one per
    core);
(b) ours: ``TorchModel(model=net, feature_cols=["features"]).transform(df)`` on
    ``local[2]``, written to Spark's ``noop`` sink (every row's prediction computed, nothing
    stored). ``df`` is the Parquet of the rows read from the files in each pass (the OS page
    cache warm: the main figure, what a user's transform of a table does), and once cached
    in Spark's memory first (``df.cache()``); the same passes without the model (``df`` to
    the noop sink) are shown for what Spark alone costs;
(c) row-at-a-time: a plain Python UDF (``F.udf``, one call per row) that runs the same
    model on one row, ``model(torch.tensor(row)[None])``, with one torch thread per task, as
    a per-row transform would; on the first ``--udf-rows`` rows only (their own Parquet files,
    so Spark still runs two tasks), reported in rows/s.

Targets: ours (from Parquet) >= 0.7 x raw, and >= 20 x the row-at-a-time UDF. Results are
printed and written to ``benchmarks/results/transform_throughput.md`` (a run smaller than the full
job writes to a temporary folder instead; ``--no-record`` writes nothing).

Run from the repository root::

    .venv/bin/python benchmarks/transform_throughput.py
    .venv/bin/python benchmarks/transform_throughput.py --rows 50000 --udf-rows 5000  # quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402
import torch  # noqa: E402

TARGET_RAW, TARGET_UDF = 0.7, 20.0
HEADER = """\
# Transform throughput (benchmarks/transform_throughput.py)

Rows/s of `TorchModel.transform` (MLP 32-256-256-1, `local[2]`, to Spark's noop sink) on 1M
rows x 32 float32 features, against raw batched `model(x)` in one process on the same rows
as an in-memory tensor, and against a row-at-a-time Python UDF running the same model per
row (on fewer rows). Targets: transform >= 0.7 x raw and >= 20 x the row-at-a-time UDF.

    .venv/bin/python benchmarks/transform_throughput.py [--rows N] [--udf-rows N] [--repeats R]

Each run replaces the section of its stack below and keeps the others.
"""


def rate(run: Callable[[], None], rows: int, repeats: int, quiet_s: float) -> dict:
    """Rows/s of ``run`` over ``repeats`` timed calls after one untimed call."""
    run()
    rates, contended = [], 0
    for _ in range(repeats):
        contended += not bc.wait_quiet(quiet_s)
        start = time.perf_counter()
        run()
        rates.append(rows / (time.perf_counter() - start))
    return {"best": max(rates), "median": statistics.median(rates), "contended": contended}


def row_at_a_time_udf(net):
    """A Python UDF running ``net`` on one row per call (one torch thread per task)."""
    from pyspark.sql import functions as F

    state: dict = {}

    def predict(features):  # no type hints: pyspark 4 would try to infer an Arrow UDF
        model = state.get("model")
        if model is None:
            torch.set_num_threads(1)
            model = state["model"] = net.eval()
        with torch.no_grad():
            return float(model(torch.tensor(features, dtype=torch.float32)[None]))

    return F.udf(predict, "double")


def fmt(r: dict) -> str:
    return f"{r['best']:,.0f} | {r['median']:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=bc.FULL_ROWS)
    parser.add_argument("--udf-rows", type=int, default=20_000, help="rows for the per-row UDF")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=10_000, help="raw model(x) slice")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--data", default=str(bc.DATA), help="folder of the generated Parquet")
    parser.add_argument("--quiet-timeout", type=float, default=60.0)
    bc.add_record_args(parser)
    args = parser.parse_args()

    from pyspark.sql import functions as F

    from spark_estimator import TorchModel

    path = bc.dataset(args.rows, Path(args.data))
    udf_path = bc.dataset(args.udf_rows, Path(args.data))
    spark = bc.spark_session(args.master)
    env = bc.machine()
    print(f"{args.rows:,} rows; {env['cpu']}, {env['cores']} cores", flush=True)
    net = bc.mlp().eval()
    model = TorchModel(model=net, feature_cols=["features"], output_shapes=[[1]])
    results: dict[str, dict] = {}

    def run_and_print(name: str, run: Callable[[], None], rows: int) -> None:
        results[name] = rate(run, rows, args.repeats, args.quiet_timeout)
        r = results[name]
        print(f"{name:<48} best {r['best']:,.0f} rows/s, median {r['median']:,.0f}", flush=True)

    # (a) raw batched model(x) in this process
    x = torch.from_numpy(bc.job_arrays(args.rows)[0])

    def raw() -> None:
        with torch.no_grad():
            for i in range(0, len(x), args.batch_size):
                net(x[i : i + args.batch_size])

    run_and_print("raw model(x), in-memory tensor", raw, args.rows)

    # (b) ours, from Parquet and from a cached DataFrame; Spark alone for context
    def noop(df) -> Callable[[], None]:
        return lambda: df.write.format("noop").mode("overwrite").save()

    source = bc.frame(spark, path)
    partitions = source.rdd.getNumPartitions()
    run_and_print("transform, from Parquet", noop(model.transform(source)), args.rows)
    run_and_print("no model: Parquet to noop", noop(source), args.rows)
    # after the Parquet passes: Spark would read the cache for any DataFrame of the same plan
    cached = bc.frame(spark, path).cache()
    cached.count()
    run_and_print("transform, cached DataFrame", noop(model.transform(cached)), args.rows)
    run_and_print("no model: cached DataFrame to noop", noop(cached), args.rows)
    cached.unpersist(blocking=True)

    # (c) row at a time
    small = bc.frame(spark, udf_path)
    per_row = small.withColumn("prediction", row_at_a_time_udf(net)(F.col("features")))
    run_and_print("row-at-a-time Python UDF", noop(per_row), args.udf_rows)
    spark.stop()

    ours, raw_r = results["transform, from Parquet"], results["raw model(x), in-memory tensor"]
    udf_r = results["row-at-a-time Python UDF"]
    vs_raw = ours["best"] / raw_r["best"]
    vs_cached = results["transform, cached DataFrame"]["best"] / raw_r["best"]
    vs_udf = ours["best"] / udf_r["best"]
    full = args.rows >= bc.FULL_ROWS
    contended = sum(r["contended"] for r in results.values())
    lines = [
        f"## {env['date']}, stack `{env['venv']}`",
        "",
        *bc.machine_lines(env),
        f"- Rows: {args.rows:,} ({'the full job' if full else 'SMALLER THAN THE FULL JOB'}), "
        f"{args.udf_rows:,} for the per-row UDF; `{args.master}`, {partitions} Spark partitions; "
        f"raw: slices of {args.batch_size:,} rows, {torch.get_num_threads()} torch threads; "
        f"best and median of {args.repeats} timed passes after an untimed one, "
        f"{contended} pass(es) started while other processes kept the CPUs busy",
        "",
        "| configuration | best rows/s | median rows/s | best / raw |",
        "|---|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(f"| {name} | {fmt(r)} | {r['best'] / raw_r['best']:.2f} |")
    lines += [
        "",
        f"- Transform (from Parquet) / raw: **{vs_raw:.2f}** (target >= {TARGET_RAW}: "
        f"{'met' if vs_raw >= TARGET_RAW else 'MISSED'}); from a cached DataFrame / raw: "
        f"{vs_cached:.2f}",
        f"- Transform (from Parquet) / row-at-a-time UDF: **{vs_udf:.1f}** (target >= "
        f"{TARGET_UDF:g}: {'met' if vs_udf >= TARGET_UDF else 'MISSED'})",
    ]
    section = "\n".join(lines) + "\n"
    print("\n" + section)
    bc.record(args, "transform_throughput", HEADER, section, env["venv"], full)


if __name__ == "__main__":
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    main()
