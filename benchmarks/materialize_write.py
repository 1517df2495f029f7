"""Wall time of our materialization write against Spark's plain ``df.write.parquet``.

A hand-run benchmark, not a test. The rows are the job's 1M x 32 float32 features and
float32 label (see bench_common.py), read by Spark from Parquet: the features as one
``array<float>`` column (``--layout array``, default) or as a Spark ML vector
(``--layout vector``: ``array_to_vector`` on the read, the usual VectorAssembler output).
Side by side in one run, best and median of ``--repeats`` timed writes after one untimed
write of each (the OS page cache and Spark's Python workers warm), in turn:

(a) ours: ``TorchEstimator(num_proc=2, ...).materialize(df)``, the public call that does
    what ``fit`` does first: validate the params, compute the cache key, convert (vectors to
    arrays, float32) and write ``partitions_per_process x num_proc`` = 8 snappy Parquet files
    with the executors' pyarrow, checking nulls, NaN and array lengths on the way. Each
    write goes to a new, empty store (so the cache never makes it free; the script checks
    that the dataset was written, not found); the seconds of validation alone (the
    private ``_validate``, timed by ``bench_common.fit_phases``) are shown too;
(b) plain: ``df.select(features as array<float>, label as float).repartition(8)
    .write.parquet(path, compression="snappy")``: the same columns, types, number of
    files and compression, written by Spark's own writer (row groups of Spark's default
    128 MiB against our 32 MiB), to a new folder each time;
(c) plain without the repartition: the same write in the input's own partitioning.

Target: ours <= 1.2 x plain (b). Results are printed and written to
``benchmarks/results/materialize_write.md`` (a run smaller than the full job writes to a
temporary folder instead; ``--no-record`` writes nothing), one section per stack and layout.

Run from the repository root::

    .venv/bin/python benchmarks/materialize_write.py [--layout vector]
    .venv/bin/python benchmarks/materialize_write.py --rows 50000 --repeats 2  # quick
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402

TARGET = 1.2
NUM_PROC, PARTITIONS_PER_PROCESS = 2, 4
HEADER = """\
# Materialization write (benchmarks/materialize_write.py)

Seconds of `TorchEstimator.materialize(df)` (what `fit` writes first: 8 snappy Parquet files
by the executors' pyarrow, values checked on the way; a new store each time) against Spark's
`df.write.parquet` of the same columns and types, repartitioned into as many files, on 1M
rows x 32 float32 features (an `array<float>` or an ML vector column) + a float32 label,
`local[2]`. Target: ours <= 1.2 x the plain write.

    .venv/bin/python benchmarks/materialize_write.py [--rows N] [--repeats R] [--layout vector]

Each run replaces the section of its stack and layout below and keeps the others.
"""


def folder_size(path: str) -> tuple[int, int]:
    """(Parquet files, bytes) under ``path``."""
    files = [p for p in Path(path).rglob("*.parquet") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=bc.FULL_ROWS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layout", choices=("array", "vector"), default="array")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--data", default=str(bc.DATA), help="folder of the generated Parquet")
    parser.add_argument("--out-dir", default=tempfile.gettempdir(), help="where writes go")
    parser.add_argument("--quiet-timeout", type=float, default=60.0)
    bc.add_record_args(parser)
    args = parser.parse_args()

    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    from spark_estimator import Store

    path = bc.dataset(args.rows, Path(args.data))
    spark = bc.spark_session(args.master)
    env = bc.machine()
    print(f"{args.rows:,} rows, layout {args.layout}; {env['cpu']}, {env['cores']} cores")
    df = bc.frame(spark, path, args.layout)
    partitions = df.rdd.getNumPartitions()
    num_files = NUM_PROC * PARTITIONS_PER_PROCESS
    if args.layout == "vector":
        features = vector_to_array("features", "float32").alias("features")
    else:
        features = F.col("features").cast("array<float>").alias("features")
    plain_df = df.select(features, F.col("label").cast("float").alias("label"))
    info: dict[str, tuple[int, int]] = {}
    validate_s: list[float] = []
    reused: list[bool] = []

    def ours() -> tuple[Callable[[], None], str]:
        folder = tempfile.mkdtemp(prefix="materialize-store-", dir=args.out_dir)
        est = bc.estimator(
            Store.create(folder), num_proc=NUM_PROC, partitions_per_process=PARTITIONS_PER_PROCESS
        )

        def run() -> None:
            with bc.fit_phases() as times:
                written = est.materialize(df)
            validate_s.append(times.get("_validate", float("nan")))
            reused.append(bool(times.get("reused")))
            info["ours"] = folder_size(written)

        return run, folder

    def plain(repartition: bool) -> tuple[Callable[[], None], str]:
        folder = tempfile.mkdtemp(prefix="materialize-plain-", dir=args.out_dir)
        out = os.path.join(folder, "data")
        frame = plain_df.repartition(num_files) if repartition else plain_df
        name = "plain" if repartition else "plain, no repartition"

        def run() -> None:
            frame.write.option("compression", "snappy").parquet(out)
            info[name] = folder_size(out)

        return run, folder

    configs = {
        "ours: materialize(df)": ours,
        f"plain: repartition({num_files}).write.parquet": lambda: plain(True),
        "plain: write.parquet, input partitioning": lambda: plain(False),
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    contended = 0
    for r in range(args.repeats + 1):  # the first round is the untimed warm-up
        for name, make in configs.items():
            run, folder = make()
            try:
                contended += r > 0 and not bc.wait_quiet(args.quiet_timeout)
                start = time.perf_counter()
                run()
                elapsed = time.perf_counter() - start
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            if r > 0:
                times[name].append(elapsed)
            print(f"{'warm-up' if r == 0 else f'[{r}]'} {name}: {elapsed:.2f} s", flush=True)
    spark.stop()

    ours_name, plain_name, loose_name = configs
    ratio = min(times[ours_name]) / min(times[plain_name])
    full = args.rows >= bc.FULL_ROWS
    lines = [
        f"## {env['date']}, stack `{env['venv']}`, layout `{args.layout}`",
        "",
        *bc.machine_lines(env),
        f"- Rows: {args.rows:,} ({'the full job' if full else 'SMALLER THAN THE FULL JOB'}), "
        f"features as {'an ML vector' if args.layout == 'vector' else 'array<float>'} column; "
        f"`{args.master}`, {partitions} input partitions (Spark's split of "
        f"{bc.INPUT_FILES} input files); best and median of {args.repeats} timed "
        f"writes each after an untimed one, {contended} started while other processes kept "
        "the CPUs busy",
        f"- Ours wrote a new dataset every time (not found in the store): "
        f"{'yes' if not any(reused) else 'NO'}; its validation step took "
        f"{bc.best_median(validate_s)} s of it",
        "",
        "| write | best s | median s | best / plain | files | MiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    short = {ours_name: "ours", plain_name: "plain", loose_name: "plain, no repartition"}
    for name, values in times.items():
        files, size = info.get(short[name], (0, 0))
        lines.append(
            f"| {name} | {min(values):.2f} | {statistics.median(values):.2f} | "
            f"{min(values) / min(times[plain_name]):.2f} | {files} | {size / 2**20:.1f} |"
        )
    lines += [
        "",
        f"- Ours / plain (same files): **{ratio:.2f}** (target <= {TARGET}: "
        f"{'met' if ratio <= TARGET else 'MISSED'})",
    ]
    section = "\n".join(lines) + "\n"
    print("\n" + section)
    bc.record(args, "materialize_write", HEADER, section, f"{env['venv']} {args.layout}", full)
    if any(reused):
        print("FAILED: a timed materialization found its dataset in the store", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    sys.exit(main())
