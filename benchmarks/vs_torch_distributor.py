"""End-to-end time of our fit against pyspark's TorchDistributor with petastorm, same job.

A hand-run benchmark, not a test; it runs on the legacy stack, where petastorm imports
(pyspark 3.5, pyarrow 14: ``requirements-legacy.txt``, built by ``./dev.sh`` in
``.venv-legacy``). The job: 1M rows x 32 float32 features (one ``array<float>`` column) + a
float32 label, read by Spark from Parquet (see bench_common.py); MLP 32-256-256-1, MSE,
SGD(lr=0.01), 2 processes x batch 256 (global 512), 2 epochs, CPU, ``local[2]``. Side by
side in one run, in turn, ``--repeats`` times each:

(a) ours: ``TorchEstimator(num_proc=2, batch_size=256, use_gpu=False).fit(df)`` into a new,
    empty store, timed from the call to the TorchModel. Its phases as in fit_overhead.py:
    materialization (the private ``_materialize``, timed by ``bench_common.fit_phases``),
    the training job (``_launch``), of which the ranks' training loop (the longest rank's
    ``seconds`` in ``ranks.json``);
(b) theirs, the recipe of the Databricks/pyspark docs:
    ``converter = petastorm.spark.make_spark_converter(df)`` (Spark writes the DataFrame as
    Parquet under a new ``petastorm.spark.converter.parentCacheDirUrl`` folder each time, so
    petastorm's in-process cache never reuses it; its defaults: uncompressed, 32 MiB row
    groups; one file per partition of ``df`` as read, or ``--petastorm-partitions``), then
    ``TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    .run(train_fn, converter, ...)``: two barrier tasks, each starting ``torchrun`` with one
    process that joins a gloo group, wraps the model in DDP, opens
    ``converter.make_torch_dataloader(batch_size=256, num_epochs=None, cur_shard=rank,
    shard_count=2, data_loader_fn=petastorm.pytorch.BatchedDataLoader)`` (petastorm's
    defaults otherwise: 4 reader threads, row groups shuffled, no shuffling queue unless
    ``--petastorm-shuffle-capacity``) and trains ``ceil(rows / 512)`` steps per epoch; then
    the driver loads rank 0's returned weights into a model. Each process sets
    ``torch.set_num_threads(--threads)`` (1, as ours sets ``spark.task.cpus`` threads).
    Phases: the converter (materialization), ``run`` (the training job), and rank 0's loop
    from its first batch request to its last step (timed inside ``train_fn``).

Before the timed runs each side runs once untimed on 4,096 rows (1 epoch), which starts
Spark's Python workers. Before each timed run the script waits (up to ``--quiet-timeout``)
for other processes to leave the CPUs idle.

Target: ours faster end to end (theirs / ours > 1). Results are printed and written to
``benchmarks/results/vs_torch_distributor.md`` (a run smaller than the full job writes to a
temporary folder instead; ``--no-record`` writes nothing).

Run from the repository root::

    .venv-legacy/bin/python benchmarks/vs_torch_distributor.py
    .venv-legacy/bin/python benchmarks/vs_torch_distributor.py --rows 50000 --epochs 1  # quick
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402
from bench_common import LR, mlp  # noqa: E402  (pickled by value into torchrun's processes)

HEADER = """\
# Against TorchDistributor + petastorm (benchmarks/vs_torch_distributor.py)

End-to-end seconds of the same job, 1M rows x 32 float32 features + label, MLP
32-256-256-1, SGD, 2 processes x batch 256, 2 epochs, CPU, `local[2]`, on the legacy stack
(pyspark 3.5, pyarrow 14, petastorm 0.13.1): our `TorchEstimator.fit(df)` (new store each
time) against pyspark's `TorchDistributor(num_processes=2, local_mode=False)` training with
petastorm's `make_spark_converter(df)` and `BatchedDataLoader`. Target: ours faster.

    .venv-legacy/bin/python benchmarks/vs_torch_distributor.py [--rows N] [--epochs E]

Each run replaces the section of its stack below and keeps the others.
Anchor from /work/shared/DESIGN.md (2-core machine, full job): TorchDistributor + petastorm
66.6 s end to end (materialize 16.6 s, training job 44.5 s of which loop 23.5 s).
"""
PHASES = ("materialization", "training job", "of which the loop")


def train_fn(converter, rows, epochs, batch_size, threads, shuffle_capacity):
    """Run by TorchDistributor in each torchrun process: the job's DDP loop on petastorm."""
    import torch
    import torch.distributed as dist
    from petastorm.pytorch import BatchedDataLoader

    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    net = mlp()
    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = torch.nn.MSELoss()
    steps = math.ceil(rows / (world * batch_size))
    last_loss = 0.0
    start = time.perf_counter()
    with converter.make_torch_dataloader(
        batch_size=batch_size,
        num_epochs=None,
        cur_shard=rank,
        shard_count=world,
        data_loader_fn=BatchedDataLoader,
        shuffling_queue_capacity=shuffle_capacity,
    ) as loader:
        batches = iter(loader)
        for _ in range(epochs):
            total = torch.zeros(())
            for _ in range(steps):
                batch = next(batches)
                x, y = batch["features"], batch["label"].reshape(-1, 1)
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(x), y)
                loss.backward()
                optimizer.step()
                total += loss.detach()
            last_loss = float(total) / steps
    loop_s = time.perf_counter() - start
    state = {k: v.detach().cpu() for k, v in net.state_dict().items()} if rank == 0 else None
    dist.destroy_process_group()
    return {"loop_s": loop_s, "threads": torch.get_num_threads(), "loss": last_loss, "state": state}


def theirs(spark, df, rows: int, args, cache_root: str) -> dict:
    """One end-to-end TorchDistributor + petastorm run (see the docstring)."""
    from petastorm.spark import SparkDatasetConverter, make_spark_converter
    from pyspark.ml.torch.distributor import TorchDistributor

    parent = tempfile.mkdtemp(prefix="petastorm-cache-", dir=cache_root)
    spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, f"file://{parent}")
    try:
        start = time.perf_counter()
        converter = make_spark_converter(df)
        materialized = time.perf_counter()
        distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
        out = distributor.run(
            train_fn,
            converter,
            rows,
            args.epochs,
            bc.GLOBAL_BATCH // 2,
            args.threads,
            args.petastorm_shuffle_capacity,
        )
        trained = time.perf_counter()
        net = mlp()
        net.load_state_dict(out["state"])
        total = time.perf_counter() - start
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    return {
        "total": total,
        "materialization": materialized - start,
        "training job": trained - materialized,
        "of which the loop": out["loop_s"],
        "threads": out["threads"],
        "loss": out["loss"],
    }


def ours(df, args, store_root: str, epochs: int) -> dict:
    from spark_estimator import Store

    folder = tempfile.mkdtemp(prefix="vs-distributor-store-", dir=store_root)
    try:
        store = Store.create(folder)
        est = bc.estimator(store, num_proc=2, batch_size=bc.GLOBAL_BATCH // 2, epochs=epochs)
        fit = bc.timed_fit(est, df, store)
        history = fit["model"].getHistory()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "total": fit["total"],
        "materialization": fit["times"].get("_materialize"),
        "training job": fit["times"].get("_launch"),
        "of which the loop": fit["train_s"],
        "loss": history[-1]["train"]["loss"] if history else None,
    }


def fmt(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=bc.FULL_ROWS)
    parser.add_argument("--epochs", type=int, default=bc.FULL_EPOCHS)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each side")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, theirs")
    parser.add_argument("--petastorm-shuffle-capacity", type=int, default=0)
    parser.add_argument(
        "--petastorm-partitions",
        type=int,
        default=0,
        help="repartition the DataFrame before make_spark_converter (default: as read)",
    )
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--data", default=str(bc.DATA), help="folder of the generated Parquet")
    parser.add_argument("--store-dir", default=tempfile.gettempdir(), help="stores and caches")
    parser.add_argument("--quiet-timeout", type=float, default=60.0)
    bc.add_record_args(parser)
    args = parser.parse_args()
    try:
        import petastorm  # noqa: F401
    except Exception as e:
        sys.exit(
            f"vs_torch_distributor.py: petastorm does not import on this stack ({e!r}); run it "
            "on the legacy stack: .venv-legacy/bin/python benchmarks/vs_torch_distributor.py"
        )

    path = bc.dataset(args.rows, Path(args.data))
    spark = bc.spark_session(args.master)
    df = bc.frame(spark, path)
    env = bc.machine(("petastorm",))
    print(f"{args.rows:,} rows, {args.epochs} epochs; {env['cpu']}, {env['cores']} cores")

    # petastorm needs at least one row group per rank; Spark writes one file per partition
    petastorm_df = df.repartition(args.petastorm_partitions) if args.petastorm_partitions else df
    petastorm_partitions = petastorm_df.rdd.getNumPartitions()
    small = df.limit(4096)
    start = time.perf_counter()
    ours(small, args, args.store_dir, 1)
    warm_ours = time.perf_counter() - start
    start = time.perf_counter()
    warm_args = argparse.Namespace(**{**vars(args), "epochs": 1})
    theirs(spark, small.repartition(2), 4096, warm_args, args.store_dir)  # a row group per rank
    warm_theirs = time.perf_counter() - start
    print(f"warm-up (4,096 rows): ours {warm_ours:.1f} s, theirs {warm_theirs:.1f} s", flush=True)

    runs: dict[str, list[dict]] = {"ours": [], "theirs": []}
    contended = 0
    for r in range(args.repeats):
        for side in ("ours", "theirs"):
            contended += not bc.wait_quiet(args.quiet_timeout)
            if side == "ours":
                result = ours(df, args, args.store_dir, args.epochs)
            else:
                result = theirs(spark, petastorm_df, args.rows, args, args.store_dir)
            runs[side].append(result)
            phases = ", ".join(f"{p} {fmt(result[p])} s" for p in PHASES)
            print(f"[{r + 1}] {side}: {result['total']:.2f} s ({phases})", flush=True)
    spark.stop()

    best = {side: min(rs, key=lambda x: x["total"]) for side, rs in runs.items()}
    ratio = best["theirs"]["total"] / best["ours"]["total"]
    full = args.rows >= bc.FULL_ROWS and args.epochs == bc.FULL_EPOCHS
    lines = [
        f"## {env['date']}, stack `{env['venv']}`",
        "",
        *bc.machine_lines(env, ("petastorm",)),
        f"- Job: {args.rows:,} rows, {args.epochs} epoch(s) "
        f"({'the full job' if full else 'SMALLER THAN THE FULL JOB'}); 2 processes x batch "
        f"{bc.GLOBAL_BATCH // 2} on `{args.master}`; torch threads per process: theirs "
        f"{best['theirs']['threads']}, ours spark.task.cpus (1); petastorm shuffling queue "
        f"{args.petastorm_shuffle_capacity} rows; petastorm's Parquet written from "
        f"{petastorm_partitions} partitions; {args.repeats} timed run(s) each, "
        f"{contended} started while other processes kept the CPUs busy",
        f"- Untimed warm-up on 4,096 rows: ours {warm_ours:.1f} s, theirs {warm_theirs:.1f} s",
        "",
        "| side | end to end s | " + " | ".join(PHASES) + " | last epoch's train loss |",
        "|---|---:|" + "---:|" * len(PHASES) + "---:|",
    ]
    names = {"ours": "ours: fit(df)", "theirs": "TorchDistributor + petastorm"}
    for side, rs in runs.items():
        for i, res in enumerate(rs):
            cells = " | ".join(fmt(res[p]) for p in PHASES)
            loss = "n/a" if res["loss"] is None else f"{res['loss']:.4f}"
            lines.append(f"| {names[side]} ({i + 1}) | {res['total']:.2f} | {cells} | {loss} |")
    totals = {side: statistics.median(r["total"] for r in rs) for side, rs in runs.items()}
    lines += [
        "",
        f"- TorchDistributor + petastorm / ours, end to end: **{ratio:.2f}** (best of each; "
        f"median {totals['theirs'] / totals['ours']:.2f}; target > 1: "
        f"{'met' if ratio > 1 else 'MISSED'})",
        f"- Materialization, theirs / ours: "
        f"{best['theirs']['materialization'] / best['ours']['materialization']:.2f}; "
        f"training loop, theirs / ours: "
        f"{best['theirs']['of which the loop'] / best['ours']['of which the loop']:.2f}",
    ]
    section = "\n".join(lines) + "\n"
    print("\n" + section)
    bc.record(args, "vs_torch_distributor", HEADER, section, env["venv"], full)


if __name__ == "__main__":
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    main()
