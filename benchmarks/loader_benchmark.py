"""Throughput of the executor-side data loader, in rows/s, against a plain-pyarrow ceiling.

A hand-run benchmark, not a test. One process (world_size 1, rank 0), batch size 512, no
model: every batch is consumed (its length touched) and dropped. It measures, each over full
passes of the dataset, the best and the median of ``--repeats`` timed passes:

(a) ceiling: a plain loop over every row group of every file,
    ``pq.ParquetFile(path).read_row_group(i, columns=...)`` and
    ``torch.from_numpy(column.to_numpy())`` per column, nothing else (no batching);
(b) our loader, ``open_loader(...)`` + ``ShardLoader.batches(StepPlan(...).batch_sizes, pass)``
    with reader="arrow", shuffle on (default buffer) and shuffle off;
(c) petastorm: ``make_batch_reader`` + ``petastorm.pytorch.BatchedDataLoader`` over the same
    files, shuffle on and off (only where ``import petastorm`` works: the legacy stack);
(d) our loader with reader="petastorm" (same condition).

The dataset (``--rows`` rows of 32 float32 columns ``f0..f31`` and a float32 label ``y``, in
8 snappy Parquet files written by pyarrow from a fixed numpy seed) is generated once and kept
under ``--data``; its DatasetInfo (row groups from the footers) is saved next to it. The OS
page cache is warmed with one untimed pass of every file, and each configuration gets one
untimed pass before its timed ones.

Results are printed and written to ``benchmarks/results/loader.md``, one section per stack
(virtual environment): re-running on a stack replaces that stack's section.

Run from the repository root, on both stacks::

    .venv/bin/python benchmarks/loader_benchmark.py
    .venv-legacy/bin/python benchmarks/loader_benchmark.py   # pyarrow 14 + petastorm 0.13.1
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402

from spark_estimator.shared.spec import ColumnSpec, DatasetInfo
from spark_estimator.store import Store
from spark_estimator.worker.data.loader import open_loader
from spark_estimator.worker.data.shards import StepPlan
from spark_estimator.worker.data.shuffle import DEFAULT_BUFFER_BYTES

SEED = 20240601
FEATURES = 32
NUM_FILES = 8
BATCH_SIZE = 512
COLUMNS = [f"f{i}" for i in range(FEATURES)] + ["y"]
ROW_BYTES = 4 * len(COLUMNS)
RESULTS = Path(__file__).resolve().parent / "results" / "loader.md"
# /work/shared/DESIGN.md, "Measured anchors" (this 2-core machine, 1M x 32 float rows)
ANCHOR_PYARROW = 4.15e6
ANCHOR_PETASTORM = 1.94e6
TARGET_CEILING, TARGET_PETASTORM = 0.8, 2.0

HEADER = """\
# Loader throughput (benchmarks/loader_benchmark.py)

Rows/s of one rank's training loader (world_size 1, batch 512, no model) over full passes of
a Parquet dataset of 1M+ rows x 32 float32 features + a float32 label, against a plain pyarrow
row-group read (the ceiling) and petastorm's BatchedDataLoader (legacy stack only).
Targets: our shuffled loader >= 0.8 x the ceiling and >= 2 x petastorm's BatchedDataLoader.

Run from the repository root (the dataset is generated once under `--data`):

    .venv/bin/python benchmarks/loader_benchmark.py [--data DIR] [--rows N] [--repeats R]
    .venv-legacy/bin/python benchmarks/loader_benchmark.py   # pyarrow 14 + petastorm 0.13.1

Each run replaces the section of its stack (virtual environment) below and keeps the others.
Anchors from /work/shared/DESIGN.md (same 2-core machine, 1M x 32 float rows): plain pyarrow
row-group read into tensors 4.15 M rows/s; petastorm BatchedDataLoader 1.94 M rows/s.
"""


# -- the dataset ---------------------------------------------------------------------------
def dataset(folder: Path, rows: int, row_group_rows: int) -> DatasetInfo:
    """The benchmark dataset under ``folder``, written unless an identical one is there."""
    meta_path = folder / "_bench_meta.json"
    want = {"rows": rows, "seed": SEED, "files": NUM_FILES, "row_group_rows": row_group_rows}
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("params") == want:
            return DatasetInfo.from_json(str(folder), meta["info"], reused=True)
    print(f"writing {rows:,} rows x {len(COLUMNS)} float32 columns to {folder} ...", flush=True)
    rng = np.random.default_rng(SEED)
    (folder / "train").mkdir(parents=True, exist_ok=True)
    files = []
    per_file = [rows // NUM_FILES + (1 if i < rows % NUM_FILES else 0) for i in range(NUM_FILES)]
    for i, n in enumerate(per_file):
        values = rng.standard_normal((len(COLUMNS), n), dtype=np.float32)
        table = pa.table({name: values[j] for j, name in enumerate(COLUMNS)})
        relpath = f"train/part-{i:05d}.parquet"
        pq.write_table(table, folder / relpath, row_group_size=row_group_rows, compression="snappy")
        footer = pq.ParquetFile(folder / relpath).metadata
        files.append(
            (relpath, [footer.row_group(g).num_rows for g in range(footer.num_row_groups)])
        )
    info = DatasetInfo(
        path=str(folder),
        features=[ColumnSpec(f"f{i}", "scalar", "float32") for i in range(FEATURES)],
        labels=[ColumnSpec("y", "scalar", "float32")],
        files={"train": files},
    )
    meta_path.write_text(json.dumps({"params": want, "info": info.to_json()}, indent=1))
    return info


# -- the passes: each returns the rows it delivered ----------------------------------------
def ceiling_pass(info: DatasetInfo) -> int:
    rows = 0
    for relpath, _ in info.files["train"]:
        parquet = pq.ParquetFile(os.path.join(info.path, relpath))
        for i in range(parquet.num_row_groups):
            table = parquet.read_row_group(i, columns=COLUMNS)
            tensors = [torch.from_numpy(table.column(c).to_numpy()) for c in COLUMNS]
            rows += len(tensors[-1])
    return rows


def loader_pass(info: DatasetInfo, store: Store, **options) -> Callable[[int], int]:
    spec = bc.loader_only_spec(info, store, BATCH_SIZE, **options)
    total = info.rows("train")
    sizes = StepPlan(total, 1, 0, BATCH_SIZE).batch_sizes

    def run(pass_index: int) -> int:
        loader = open_loader(spec, "train", 1, 0, pin=False)
        rows = 0
        for batch in loader.batches(sizes, pass_index):
            rows += len(batch["y"])
        return rows

    return run


def petastorm_pass(info: DatasetInfo, shuffle: bool, capacity: int) -> Callable[[int], int]:
    from petastorm import make_batch_reader
    from petastorm.pytorch import BatchedDataLoader

    urls = [f"file://{os.path.join(info.path, p)}" for p, _ in info.files["train"]]

    def run(pass_index: int) -> int:
        reader = make_batch_reader(
            urls,
            schema_fields=COLUMNS,
            num_epochs=1,
            shuffle_row_groups=shuffle,
            seed=pass_index if shuffle else None,
        )
        rows = 0
        with BatchedDataLoader(
            reader, batch_size=BATCH_SIZE, shuffling_queue_capacity=capacity if shuffle else 0
        ) as loader:
            for batch in loader:
                rows += len(batch["y"])
        return rows

    return run


def silenced(run: Callable[[int], int]) -> Callable[[int], int]:
    """``run`` with its prints dropped (petastorm's reader prints "Cache cleanup complete.")."""

    def quiet(pass_index: int) -> int:
        with contextlib.redirect_stdout(io.StringIO()):
            return run(pass_index)

    return quiet


def measure(run: Callable[[int], int], expect: int, repeats: int, quiet_s: float) -> dict:
    run(0)  # untimed warm-up pass
    rates, contended = [], 0
    for r in range(repeats):
        contended += not bc.wait_quiet(quiet_s)
        start = time.perf_counter()
        rows = run(r + 1)
        elapsed = time.perf_counter() - start
        if rows != expect:
            raise RuntimeError(f"a pass delivered {rows} rows, expected {expect}")
        rates.append(rows / elapsed)
    return {
        "best": max(rates),
        "median": statistics.median(rates),
        "all": rates,
        "contended": contended,
    }


# -- the machine ---------------------------------------------------------------------------
def machine() -> dict:
    return {**bc.machine(("petastorm",)), "torch_threads": torch.get_num_threads()}


# -- the report ----------------------------------------------------------------------------
def fmt(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate / 1e6:.2f} M"


def ratio(a: dict | None, b: dict | None) -> str:
    if a is None or b is None:
        return "n/a"
    return f"{a['best'] / b['best']:.2f} (median {a['median'] / b['median']:.2f})"


def section(env: dict, args, info: DatasetInfo, results: list[tuple[str, dict | str]]) -> str:
    groups = [g for _, gs in info.files["train"] for g in gs]
    stamp = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    lines = [
        f"## {stamp}, stack `{env['venv']}`",
        "",
        f"- Machine: {env['cpu']}, {env['cores']} cores, {env['ram_gib']:.1f} GiB RAM; "
        f"torch threads {env['torch_threads']}",
        f"- Python {env['python']} (`{env['venv']}`), pyarrow {env['pyarrow']}, "
        f"torch {env['torch']}, numpy {env['numpy']}, pyspark {env['pyspark']}, "
        f"petastorm {env['petastorm']}",
        f"- Code: {env['commit']}; 1-minute load average {env['load']:.2f} before the run, "
        f"{os.getloadavg()[0]:.2f} after (other processes share the 2 cores; re-run if high)",
        f"- Data: {info.rows('train'):,} rows x {len(COLUMNS)} float32 columns "
        f"({info.rows('train') * ROW_BYTES / 2**20:.0f} MiB decoded), {NUM_FILES} snappy files, "
        f"{len(groups)} row groups of up to {max(groups):,} rows "
        f"({max(groups) * ROW_BYTES / 2**20:.1f} MiB), under `{args.data}`",
        f"- Batch size {BATCH_SIZE}, world_size 1, rank 0; best and median of {args.repeats} "
        "timed full passes after one untimed pass per configuration; OS page cache warmed by "
        "one untimed read of every file first (the files fit in RAM, so no pass touches disk); "
        "before each timed pass the script waits (up to --quiet-timeout) for other processes to "
        "leave the CPUs idle",
        "- Ours: LoaderSpec defaults (num_workers 2 reader threads, shuffle buffer None = "
        f"{DEFAULT_BUFFER_BYTES // 2**20} MiB worth of rows, i.e. the whole dataset here). "
        "petastorm: make_batch_reader defaults (thread pool, 10 workers), num_epochs 1, "
        "shuffle_row_groups as the shuffle setting, BatchedDataLoader(batch_size=512, "
        "shuffling_queue_capacity=buffer rows or 0)",
        "",
        "| configuration | best rows/s | median rows/s | best / ceiling | passes under load |",
        "|---|---:|---:|---:|---:|",
    ]
    by_name = {name: r for name, r in results}
    ceiling = by_name.get("ceiling")
    for name, r in results:
        if isinstance(r, str):
            lines.append(f"| {name} | {r} | | | |")
        else:
            rel = f"{r['best'] / ceiling['best']:.2f}" if isinstance(ceiling, dict) else ""
            lines.append(
                f"| {name} | {fmt(r['best'])} | {fmt(r['median'])} | {rel} | "
                f"{r['contended']} of {len(r['all'])} |"
            )
    ours, ours_plain = by_name.get("ours arrow, shuffle"), by_name.get("ours arrow, no shuffle")
    peta = next((r for n, r in results if n.endswith("as ours)") and isinstance(r, dict)), None)
    peta_plain = by_name.get("petastorm BatchedDataLoader, no shuffle")
    peta_plain = peta_plain if isinstance(peta_plain, dict) else None
    anchor = {"best": ANCHOR_PETASTORM, "median": ANCHOR_PETASTORM}
    lines += [
        "",
        f"- Ours shuffled / ceiling: {ratio(ours, ceiling)} (target >= {TARGET_CEILING})",
        f"- Ours shuffled / petastorm BatchedDataLoader shuffled, same buffer, measured here: "
        f"{ratio(ours, peta)} (target >= {TARGET_PETASTORM}); unshuffled, ours / petastorm: "
        f"{ratio(ours_plain, peta_plain)}",
        f"- For context, against the DESIGN.md anchors: ceiling / 4.15 M = "
        f"{ceiling['best'] / ANCHOR_PYARROW:.2f}; ours shuffled / 1.94 M (petastorm anchor) = "
        f"{ratio(ours, anchor)}",
    ]
    return "\n".join(lines) + "\n"


def write_results(text: str, venv: str) -> None:
    """Replace this stack's section in the results file, keep the others, refresh the header."""
    bc.replace_section(RESULTS, HEADER, venv, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="/tmp/spark-estimator-bench", help="dataset folder")
    parser.add_argument("--rows", type=int, default=1_048_576, help="rows (at least 1M)")
    parser.add_argument("--repeats", type=int, default=7, help="timed passes per config (>= 3)")
    parser.add_argument("--row-group-rows", type=int, default=65_536, help="rows per row group")
    parser.add_argument(
        "--quiet-timeout",
        type=float,
        default=120,
        help="before each timed pass, wait up to this many seconds for other processes to "
        "leave the CPUs idle (a pass timed while they are busy counts as contended)",
    )
    parser.add_argument("--no-write", action="store_true", help="print only, keep loader.md")
    args = parser.parse_args()
    if args.rows < 1_000_000 or args.repeats < 3:
        parser.error("use --rows >= 1000000 and --repeats >= 3")
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    warnings.filterwarnings("ignore", category=FutureWarning)  # petastorm on pyarrow 14

    folder = Path(args.data).resolve()
    info = dataset(folder, args.rows, args.row_group_rows)
    store = Store.create(str(folder))
    total = info.rows("train")
    ceiling_pass(info)  # warm the OS page cache
    env = machine()
    print(f"{total:,} rows; {env['cpu']}, {env['cores']} cores; stack {env['venv']}", flush=True)

    default_buffer = DEFAULT_BUFFER_BYTES // ROW_BYTES
    configs: list[tuple[str, Callable[[], Callable[[int], int]] | None]] = [
        ("ceiling", lambda: lambda _: ceiling_pass(info)),
        ("ours arrow, shuffle", lambda: loader_pass(info, store)),
        ("ours arrow, no shuffle", lambda: loader_pass(info, store, shuffle=False)),
    ]
    try:
        import petastorm  # noqa: F401

        have_petastorm = True
    except Exception as e:
        have_petastorm, why = False, f"not installed on this stack ({type(e).__name__})"
    same = min(default_buffer, total)
    petastorm_configs = [
        (
            f"petastorm BatchedDataLoader, shuffle ({same:,}-row buffer, as ours)",
            lambda: petastorm_pass(info, True, same),
        ),
        (
            "petastorm BatchedDataLoader, shuffle (10,000-row buffer)",
            lambda: petastorm_pass(info, True, 10_000),
        ),
        ("petastorm BatchedDataLoader, no shuffle", lambda: petastorm_pass(info, False, 0)),
        (
            "ours petastorm reader, shuffle",
            lambda: silenced(loader_pass(info, store, reader="petastorm")),
        ),
    ]
    configs += [(name, make if have_petastorm else None) for name, make in petastorm_configs]

    results: list[tuple[str, dict | str]] = []
    for name, make in configs:
        if make is None:
            results.append((name, why))
            print(f"{name:<66} {why}", flush=True)
            continue
        start = time.perf_counter()
        r = measure(make(), total, args.repeats, args.quiet_timeout)
        results.append((name, r))
        print(
            f"{name:<66} best {fmt(r['best'])} rows/s, median {fmt(r['median'])} rows/s "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )

    text = section(env, args, info, results)
    print("\n" + text)
    if not args.no_write:
        write_results(text, env["venv"])
        print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
