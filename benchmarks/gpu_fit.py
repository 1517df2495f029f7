"""Samples/s of ``fit`` on one GPU against the same model trained on tensors already there.

A hand-run benchmark, not a test; it needs a CUDA GPU and exits with a message (status 2)
where torch sees none. The model is made compute-bound: an MLP 32 -> ``--hidden`` (4096)
x ``--depth`` (3) hidden layers -> 1 with ReLUs (about 34 M weights, 0.2 GFLOP per row for
forward and backward); the rows are the job's 1M x 32 float32 features + float32 label (see
bench_common.py), MSE, SGD(lr=0.01), batch 512, 2 epochs, float32 throughout (torch's
defaults: no TF32, no autocast) on both sides. Side by side in one run, ``--repeats``
times each:

(a) baseline: the rows copied to the GPU once as two tensors, then a loop of
    ``torch.randperm`` shuffled batches of 512 on the GPU, timed from the first step to the
    last (``torch.cuda.synchronize`` at both ends; ``bench_common.hand_loop``), after an
    untimed warm-up of 50 steps;
(b) ours: ``TorchEstimator(use_gpu=True, num_proc=1, batch_size=512).fit(df)`` on a
    ``local-cluster[1, <cores>, <MiB>]`` whose executor has the GPU
    (``spark.executor.resource.gpu.amount 1`` found by ``conf/get_gpus_resources.sh``,
    ``spark.task.resource.gpu.amount 1``), ``df`` read by Spark from Parquet. The data is
    materialized first (``materialize(df)``, untimed: with one GPU per task Spark runs the
    write's tasks one at a time), so the timed fits reuse it. Its samples/s is rows x epochs
    / the rank's training time (``seconds`` in ``runs/<run_id>/ranks.json``, from the end of
    its setup to the end of its loop, checkpoints included); the fit's total wall time is
    shown too. The script checks in ``ranks.json`` that the rank trained on ``cuda:0``.

One untimed fit of 4,096 rows first starts the executor's Python worker and its CUDA
context. Target: ours >= 0.9 x the baseline (training samples/s). Results are printed and
written to ``benchmarks/results/gpu_fit.md`` (a run smaller than the full job writes to a
temporary folder instead; ``--no-record`` writes nothing).

Run from the repository root on a machine with a CUDA GPU and a CUDA build of torch::

    python benchmarks/gpu_fit.py [--hidden 4096] [--depth 3] [--rows N] [--epochs E]
    python benchmarks/gpu_fit.py --rows 50000 --epochs 1 --repeats 1  # quick
    python benchmarks/gpu_fit.py --compile  # both sides torch.compile'd

``--compile`` compiles both sides with ``torch.compile``'s defaults (inductor): the
baseline's model, and the fit's with ``compile=True``. The baseline compiles in its untimed
warm-up (its timed models are new instances of the same class, which reuse dynamo's
cache); ours compiles in the warm-up fit and again in each timed fit's first steps unless
the executor's Python worker kept that cache, so its training time may include compile
time, a bias against ours that the line "torch.compile" of the results states. Its results
go to ``gpu_fit_compile.md``, so the eager results stay.

``--cpu-dry-run`` runs the same code paths on CPU with a small model on a local-cluster
without GPU resources (nothing recorded), to check the script on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402
import torch  # noqa: E402

TARGET = 0.9
DISCOVERY = bc.ROOT / "conf" / "get_gpus_resources.sh"
HEADER = """\
# Fit on one GPU (benchmarks/gpu_fit.py)

Training samples/s of `TorchEstimator.fit` with `use_gpu=True, num_proc=1` (a
`local-cluster` executor holding the GPU through Spark's resource scheduling; the data
materialized beforehand) against the same compute-bound model (MLP 32-4096x3-1, float32)
trained by a plain loop on tensors already on the GPU; 1M rows x 32 float32 features +
label, batch 512, SGD, 2 epochs. Target: ours >= 0.9 x the baseline.

    python benchmarks/gpu_fit.py [--hidden H] [--depth D] [--rows N] [--epochs E]

Each run replaces the section of its stack below and keeps the others.
"""


def cluster_session(cores: int, memory_mb: int, gpu: bool = True):
    """One executor of ``cores`` cores, all of them for its one task, holding the GPU."""
    conf = {"spark.task.cpus": cores}
    if gpu:
        conf.update(
            {
                "spark.worker.resource.gpu.amount": 1,
                "spark.worker.resource.gpu.discoveryScript": DISCOVERY,
                "spark.executor.resource.gpu.amount": 1,
                "spark.task.resource.gpu.amount": 1,
            }
        )
    master = f"local-cluster[1,{cores},{memory_mb}]"
    return bc.spark_session(master, conf), master


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=bc.FULL_ROWS)
    parser.add_argument("--epochs", type=int, default=bc.FULL_EPOCHS)
    parser.add_argument("--hidden", type=int, default=4096, help="width of the hidden layers")
    parser.add_argument("--depth", type=int, default=3, help="number of hidden layers")
    parser.add_argument("--batch-size", type=int, default=bc.GLOBAL_BATCH)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--executor-cores", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--executor-memory-mb", type=int, default=8192)
    parser.add_argument("--data", default=str(bc.DATA), help="folder of the generated Parquet")
    parser.add_argument("--store-dir", default=tempfile.gettempdir(), help="where stores go")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile both sides: the baseline's model and the fit's (compile=True)",
    )
    parser.add_argument("--cpu-dry-run", action="store_true", help=argparse.SUPPRESS)
    bc.add_record_args(parser)
    args = parser.parse_args()
    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        print(
            f"gpu_fit.py: no CUDA GPU here (torch {torch.__version__}: "
            f"torch.cuda.is_available() is False), so there is nothing to measure. Run it on "
            "a machine with an NVIDIA GPU, nvidia-smi and a CUDA build of torch.",
            file=sys.stderr,
        )
        return 2
    if dry:
        args.no_record, args.hidden = True, min(args.hidden, 64)
        args.executor_memory_mb = min(args.executor_memory_mb, 2048)
        print("--cpu-dry-run: CPU, no GPU resources, hidden width <= 64, nothing recorded")
    device = "cpu" if dry else "cuda"
    hidden = (args.hidden,) * args.depth

    def baseline_model() -> torch.nn.Module:
        net = bc.mlp(hidden)
        return torch.compile(net) if args.compile else net

    from spark_estimator import Store

    path = bc.dataset(args.rows, Path(args.data))
    env = bc.machine()
    print(
        f"{args.rows:,} rows, {args.epochs} epochs, MLP 32-{args.hidden}x{args.depth}-1; "
        f"GPU: {env['gpu']}",
        flush=True,
    )
    samples = args.rows * args.epochs

    # (a) baseline: tensors already on the device
    x, y = bc.job_arrays(args.rows)
    x = torch.from_numpy(x).to(device)
    y = torch.from_numpy(y).unsqueeze(1).to(device)
    bc.hand_loop(
        baseline_model(),
        x[: 50 * args.batch_size],
        y[: 50 * args.batch_size],
        args.batch_size,
        1,
        device,
    )  # warm-up: CUDA context, cuBLAS handles
    baseline = []
    for r in range(args.repeats):
        baseline.append(bc.hand_loop(baseline_model(), x, y, args.batch_size, args.epochs, device))
        print(f"[{r + 1}] baseline: {baseline[-1]:.2f} s, {samples / baseline[-1]:,.0f} samples/s")
    del x, y
    if not dry:
        torch.cuda.empty_cache()

    # (b) ours
    cores = args.executor_cores
    spark, master = cluster_session(cores, args.executor_memory_mb, gpu=not dry)
    df = bc.frame(spark, path)
    folder = tempfile.mkdtemp(prefix="gpu-fit-store-", dir=args.store_dir)
    fits, devices, backends = [], set(), set()
    try:
        store = Store.create(folder)
        params = dict(num_proc=1, batch_size=args.batch_size, use_gpu=not dry)
        if args.compile:
            params["compile"] = True
        start = time.perf_counter()
        bc.estimator(store, bc.mlp(hidden), epochs=1, **params).fit(df.limit(4096))
        print(f"warm-up fit (4,096 rows): {time.perf_counter() - start:.1f} s", flush=True)
        est = bc.estimator(store, bc.mlp(hidden), epochs=args.epochs, **params)
        start = time.perf_counter()
        est.materialize(df)
        materialize_s = time.perf_counter() - start
        for r in range(args.repeats):
            fit = bc.timed_fit(est, df, store)
            total, train_s = fit["total"], fit["train_s"]
            devices |= {r["device"] for r in fit["ranks"]}
            backends |= {r.get("compiled") for r in fit["ranks"]}
            fits.append({"total": total, "train_s": train_s})
            print(
                f"[{r + 1}] ours: fit {total:.2f} s, training {train_s:.2f} s, "
                f"{samples / train_s:,.0f} samples/s on {sorted(devices)}",
                flush=True,
            )
    finally:
        spark.stop()
        shutil.rmtree(folder, ignore_errors=True)

    base_rate = samples / min(baseline)
    ours_rate = samples / min(f["train_s"] for f in fits)
    fit_rate = samples / min(f["total"] for f in fits)
    ratio = ours_rate / base_rate
    on_gpu = devices == {"cuda:0"}
    compiled = (
        f"both sides, inductor (ours: {sorted(map(str, backends))} in ranks.json); the "
        "baseline compiled in its untimed warm-up, ours may compile inside its timed loop"
        if args.compile
        else "no (eager on both sides)"
    )
    full = args.rows >= bc.FULL_ROWS and args.epochs == bc.FULL_EPOCHS
    lines = [
        f"## {env['date']}, stack `{env['venv']}`",
        "",
        *bc.machine_lines(env),
        f"- Job: {args.rows:,} rows, {args.epochs} epoch(s) "
        f"({'the full job' if full else 'SMALLER THAN THE FULL JOB'}), MLP 32-"
        f"{args.hidden}x{args.depth}-1, batch {args.batch_size}, float32; ours on "
        f"`{master}`, spark.task.cpus {cores}; best "
        f"of {args.repeats} run(s) each; materialization beforehand took {materialize_s:.1f} s",
        f"- Ours trained on: {', '.join(sorted(devices))}"
        + ("" if on_gpu else " (NOT the GPU: the comparison is void)"),
        f"- torch.compile: {compiled}",
        "",
        "| side | samples/s | seconds (best) |",
        "|---|---:|---:|",
        f"| baseline: tensors on the GPU | {base_rate:,.0f} | {min(baseline):.2f} |",
        f"| ours: fit, training loop (ranks.json) | {ours_rate:,.0f} | "
        f"{min(f['train_s'] for f in fits):.2f} |",
        f"| ours: fit, total wall time (data already materialized) | {fit_rate:,.0f} | "
        f"{min(f['total'] for f in fits):.2f} |",
        "",
        f"- Ours (training loop) / baseline: **{ratio:.2f}** (target >= {TARGET}: "
        f"{'met' if ratio >= TARGET and on_gpu else 'MISSED'}); whole fit / baseline: "
        f"{fit_rate / base_rate:.2f}",
    ]
    section = "\n".join(lines) + "\n"
    print("\n" + section)
    name = "gpu_fit_compile" if args.compile else "gpu_fit"
    bc.record(args, name, HEADER, section, env["venv"], full)
    if not dry and not on_gpu:
        print(f"FAILED: the fit trained on {sorted(devices)}, not cuda:0", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    sys.exit(main())
