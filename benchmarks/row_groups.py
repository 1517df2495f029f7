"""Training loader throughput on tables read in place whose row groups are not ours.

A hand-run benchmark, not a test (issue: the first fit on a Parquet table). Lake tables
often hold one huge row group, or a great many tiny ones; a fit reads them where they lie
(``driver.in_place``), so the loader must not slow down on either. The same 1M rows x 32
float32 features + a float32 label are written three ways:

- ``ours``: as a fit's materialization writes them (row groups of ``row_group_size_mb``'s
  default 32 MiB; 4 files), read as a materialized dataset: the baseline;
- ``one group``: one file holding one row group of all the rows (~132 MiB);
- ``tiny groups``: one file of 1,000 row groups (~1,049 rows each);

and the last two are read in place (``DatasetInfo.in_place``, their layout and row-group
sizes from the footers as a fit records them). For each, one rank's training loader
(shuffle on, default buffer, batch 512, no model: each batch's length touched) is timed
over full passes, a new loader per pass (its opening counted), at world size 1 (rank 0)
and 2 (rank 0, then rank 1, each alone: per-rank throughput), and, as a rank holding its
shard in memory does once per fit, reading the shard whole. Target: each layout read in
place >= 0.9x the rows/s of ``ours`` at the same world size and rank.

Then whole fits (``--fit-epochs``, 2 by default; 0: none): the training job of a fit of
each layout in place, against a re-fit of our own copy of the rows (``data_copy='always'``),
with the shards held in memory (the default where they fit) and streamed.

Run from the repository root::

    .venv/bin/python benchmarks/row_groups.py [--rows N] [--repeats R] [--uncut]
        [--fit-epochs E] [--no-record]

Results go to ``benchmarks/results/row_groups.md`` (this stack's section).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402

from spark_estimator.driver.in_place import table_layout
from spark_estimator.shared.spec import ColumnSpec, DatasetInfo, InPlace
from spark_estimator.store import Store
from spark_estimator.worker.data import loader as loader_module
from spark_estimator.worker.data.loader import open_loader
from spark_estimator.worker.data.shards import StepPlan, even_pieces

SEED = 20261126
FEATURES = 32
BATCH_SIZE = 512
COLUMNS = [f"f{i}" for i in range(FEATURES)] + ["y"]
OUR_GROUP_BYTES = 32 * 2**20  # row_group_size_mb's default
TARGET = 0.9
RANKS = [(1, 0), (2, 0), (2, 1)]
MODES = [(False, world, rank) for world, rank in RANKS] + [(True, 1, 0)]

HEADER = """\
# Row groups of tables read in place (benchmarks/row_groups.py)

Rows/s of one rank's training loader (shuffle on, default buffer, batch 512, no model) over
full passes of 1M rows x 32 float32 features + a float32 label, written as a fit's
materialization writes them (`ours`, 32 MiB row groups, read as a materialized dataset) and
as lake tables hold them, read in place: one file of one ~132 MiB row group, and one file
of 1,000 tiny row groups. Target: each in-place layout >= 0.9x `ours` at the same world
size and rank. Then whole 2-rank fits of each layout, against a re-fit of our own copy.

    .venv/bin/python benchmarks/row_groups.py [--rows N] [--repeats R] [--uncut]

`--uncut` also times the in-place layouts read one piece per row group, as the loader read
them before it re-cut them (`even_pieces`).
"""


def write_layouts(folder: Path, rows: int) -> dict[str, DatasetInfo]:
    """The three layouts of the same rows under ``folder`` (written once per size)."""
    stamp = folder / f"_written_{rows}"
    rng = np.random.default_rng(SEED)
    values = rng.standard_normal((len(COLUMNS), rows), dtype=np.float32)
    table = pa.table({name: values[j] for j, name in enumerate(COLUMNS)})
    group_rows = OUR_GROUP_BYTES // (4 * len(COLUMNS))
    plans = {
        "ours": [(f"ours/part-{i}.parquet", group_rows) for i in range(4)],
        "one group": [("one_group/part-0.parquet", rows)],
        "tiny groups": [("tiny/part-0.parquet", -(-rows // 1000))],
    }
    if not stamp.exists():
        print(f"writing {rows:,} rows three ways under {folder} ...", flush=True)
        for files in plans.values():
            for i, (relpath, group) in enumerate(files):
                lo, hi = rows * i // len(files), rows * (i + 1) // len(files)
                (folder / relpath).parent.mkdir(parents=True, exist_ok=True)
                pq.write_table(table.slice(lo, hi - lo), folder / relpath, row_group_size=group)
        stamp.write_text("")
    infos = {}
    for name, files in plans.items():
        paths = [relpath for relpath, _ in files]
        footers = [pq.ParquetFile(folder / p).metadata for p in paths]
        layout, group_bytes = table_layout(paths, footers, COLUMNS)
        in_place = None
        if name != "ours":
            sizes = tuple((p, os.path.getsize(folder / p)) for p in paths)
            in_place = InPlace(
                tuple((p, tuple(g)) for p, g in layout), sizes, group_bytes=group_bytes
            )
        infos[name] = DatasetInfo(
            path=str(folder),
            features=[ColumnSpec(f"f{i}", "scalar", "float32") for i in range(FEATURES)],
            labels=[ColumnSpec("y", "scalar", "float32")],
            files={"train": layout},
            in_place=in_place,
        )
    return infos


def rows_per_second(
    info: DatasetInfo, store: Store, world: int, rank: int, repeats: int, held: bool = False
) -> list[float]:
    """One rank's loader over full passes: rows/s of each timed pass (after one untimed);
    ``held``: of reading the shard into memory, as a fit whose shard fits its budget
    does once (``DeviceShard``), then cuts every pass from memory."""
    spec = bc.loader_only_spec(info, store, BATCH_SIZE)
    sizes = StepPlan(info.rows("train"), world, rank, BATCH_SIZE).batch_sizes
    speeds = []
    for pass_index in range(repeats + 1):
        start = time.perf_counter()
        if held:
            loader = open_loader(spec, "train", world, rank, False, torch.device("cpu"))
            rows = loader.rows
        else:
            loader = open_loader(spec, "train", world, rank, pin=False)
            rows = sum(len(batch["y"]) for batch in loader.batches(sizes, pass_index))
        if pass_index:
            speeds.append(rows / (time.perf_counter() - start))
    return speeds


class Columns(torch.nn.Module):
    """The benchmark's MLP on the 32 feature columns, each given as its own argument."""

    def __init__(self):
        super().__init__()
        self.net = bc.mlp(inputs=FEATURES)

    def forward(self, *columns):
        return self.net(torch.stack(columns, 1))


def fit_seconds(args, folder: Path) -> dict[str, float]:
    """Seconds of the training job (``_train``: launch, the ranks' setup and reads, the
    epochs) of a fit of each layout read in place, against a re-fit of our own copy of
    the same rows, with each shard held in memory and streamed."""
    spark = bc.spark_session("local[2]")
    features = [f"f{i}" for i in range(FEATURES)]
    out = {}
    with tempfile.TemporaryDirectory(dir=args.store_dir) as tmp:
        for name, sub in (
            ("ours", "one_group"),
            ("one group", "one_group"),
            ("tiny groups", "tiny"),
        ):
            df = spark.read.parquet(str(folder / sub))
            for mode, fraction in (("held", 0.5), ("streamed", 0.0)):
                store = Store.create(f"{tmp}/{name}-{mode}".replace(" ", "-"))
                torch.manual_seed(0)
                params = dict(
                    feature_cols=features,
                    label_cols=["y"],
                    device_cache_fraction=fraction,
                    epochs=args.fit_epochs,
                    data_copy="always" if name == "ours" else "never",
                )
                est = bc.estimator(store, Columns(), **params)
                if name == "ours":
                    est.fit(df)  # the copy, written once: the timed fit reads it
                seconds = []
                for _ in range(args.fit_repeats):  # the best of them
                    bc.wait_quiet(args.quiet_timeout)
                    seconds.append(bc.timed_fit(est, df, store)["times"]["_train"])
                out[name, mode] = min(seconds)
                print(f"{name:12} {mode:8} fit: training job {seconds} s", flush=True)
    spark.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2**20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--data", default=str(bc.DATA / "row_groups"))
    parser.add_argument("--quiet-timeout", type=float, default=60.0)
    parser.add_argument(
        "--uncut",
        action="store_true",
        help="also time the in-place layouts read one piece per row group (without "
        "even_pieces), as the loader read them before it re-cut them",
    )
    parser.add_argument(
        "--fit-epochs", type=int, default=2, help="epochs of each fit (0: time no fits)"
    )
    parser.add_argument("--fit-repeats", type=int, default=3, help="timed fits of each")
    parser.add_argument("--store-dir", default=tempfile.gettempdir(), help="where stores go")
    bc.add_record_args(parser)
    args = parser.parse_args()
    folder = Path(args.data)
    env = bc.machine()
    infos = write_layouts(folder, args.rows)
    store = Store.create(str(folder))
    results: dict[str, dict] = {}
    runs = list(infos.items())
    if args.uncut:  # the in-place layouts again, one piece per row group (slice) as before
        runs += [(f"{name}, not re-cut", info) for name, info in runs if info.in_place]
    for name, info in runs:
        loader_module.even_pieces = even_pieces
        if name.endswith("not re-cut"):
            loader_module.even_pieces = lambda pieces, group_bytes: pieces
        for held, world, rank in MODES:
            bc.wait_quiet(args.quiet_timeout)
            speeds = rows_per_second(info, store, world, rank, args.repeats, held)
            results.setdefault(name, {})[held, world, rank] = speeds
            print(
                f"{name:12} {'held' if held else 'streamed'} world {world} rank {rank}: median "
                f"{statistics.median(speeds) / 1e6:.2f} M rows/s (best {max(speeds) / 1e6:.2f})",
                flush=True,
            )
    lines = [f"## {env['date']}, stack `{env['venv']}`", "", *bc.machine_lines(env)]
    lines += [
        f"- Data: {args.rows:,} rows x {len(COLUMNS)} float32 columns; `ours`: 4 files of"
        f" {OUR_GROUP_BYTES // 2**20} MiB row groups; median (best) of {args.repeats} timed"
        " passes after one untimed, a new loader each pass",
        "",
        "| layout | streamed, world 1 | streamed, world 2, rank 0 | streamed, world 2, rank 1"
        " | held: the shard's one read, world 1 |",
        "|---|---:|---:|---:|---:|",
    ]
    met = True
    for name, by_rank in results.items():
        cells = []
        for key in MODES:
            median = statistics.median(by_rank[key])
            ratio = median / statistics.median(results["ours"][key])
            met &= name == "ours" or "not re-cut" in name or ratio >= TARGET
            cells.append(f"{median / 1e6:.2f} M ({ratio:.2f}x)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    verdict = "met" if met else "MISSED"
    lines += ["", f"- Every in-place layout (re-cut) >= {TARGET}x `ours`: {verdict}", ""]
    if args.fit_epochs:
        fits = fit_seconds(args, folder)
        lines += [
            f"Whole fits (`local[2]`, 2 ranks, batch 256 each, MLP 32-256-256-1, "
            f"{args.fit_epochs} epochs): seconds of the training job (launch, the ranks' "
            "setup and reads, the epochs), best of "
            f"{args.fit_repeats}, each layout read in place against a re-fit of our own copy "
            "(`data_copy='always'`) of the same rows; speed relative to ours:",
            "",
            "| layout | held in memory | streamed (`device_cache_fraction=0`) |",
            "|---|---:|---:|",
        ]
        fit_met = True
        for name in ("ours", "one group", "tiny groups"):
            cells = []
            for mode in ("held", "streamed"):
                speed = fits["ours", mode] / fits[name, mode]
                fit_met &= speed >= TARGET
                cells.append(f"{fits[name, mode]:.2f} s ({speed:.2f}x)")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        verdict = "met" if fit_met else "MISSED"
        lines += ["", f"- Every layout's fit trains at >= {TARGET}x ours: {verdict}", ""]
    section = "\n".join(lines) + "\n"
    print(section)
    if not args.no_record:
        path = bc.RESULTS / "row_groups.md"
        bc.replace_section(path, HEADER, env["venv"], section)
        print(f"written to {path}")
    print(json.dumps({k: {str(m): v for m, v in d.items()} for k, d in results.items()}))


if __name__ == "__main__":
    main()
