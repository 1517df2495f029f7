"""What commits inside an epoch (``commit_every_steps``) cost the training loop.

A hand-run benchmark, not a test. The job of bench_common.py (rows x 32 float32 features,
MLP 32-256-256-1, SGD, global batch 512) on ``local[2]`` with 2 processes, 2 epochs, fitted
with ``commit_every_steps`` = 0 (only the epochs' checkpoints), an elastic fit's default
(commits timed and kept under 5% of the training time) and 4 commits an epoch,
``--repeats`` times each, alternating. Reported: the longest rank's training seconds
(``ranks.json``: the loop, checkpoints included), the commits made and the share of the
training time rank 0 spent in them (the training summary's ``commits`` and
``commit_seconds``: the gather and the write), per run.

Usage: python benchmarks/commit_cost.py [--rows N] [--repeats N]
Writes ``benchmarks/results/commit_cost.md`` with the machine.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402

from spark_estimator.worker.loop.commits import COMMITS_PER_EPOCH  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from spark_estimator import Store

    spark = bc.spark_session("local[2]")
    df = bc.frame(spark, bc.dataset(args.rows))
    batch, steps = bc.GLOBAL_BATCH // 2, -(-args.rows // bc.GLOBAL_BATCH)
    four = steps // COMMITS_PER_EPOCH
    settings = [
        ("0 (epoch checkpoints only)", 0),
        ("default of an elastic fit (timed)", None),
        (f"{four} (4 an epoch)", four),
    ]
    seconds: dict[str, list[float]] = {name: [] for name, _ in settings}
    made: dict[str, int] = {}
    spent: dict[str, list[float]] = {name: [] for name, _ in settings}
    with tempfile.TemporaryDirectory() as tmp:
        store = Store.create(tmp)
        bc.estimator(store, num_proc=2, batch_size=batch, epochs=1).fit(df)  # warm-up
        for r in range(args.repeats):
            for name, every in settings:
                bc.wait_quiet(30)
                est = bc.estimator(
                    store,
                    num_proc=2,
                    min_num_proc=2 if every is None else None,  # elastic: the default
                    batch_size=batch,
                    epochs=args.epochs,
                    commit_every_steps=every,
                    run_id=f"commits-{r}-{every}",
                )
                model = est.fit(df)
                train = max(
                    s["seconds"] for s in store.read_json(store.run(model.getRunId()).ranks)
                )
                seconds[name].append(train)
                summary = model.getTrainingSummary()
                made[name] = summary["commits"]
                spent[name].append(summary["commit_seconds"] / train)
                print(
                    f"[{r + 1}] {name}: {train:.2f} s, {made[name]} commits taking "
                    f"{summary['commit_seconds']:.3f} s",
                    flush=True,
                )
    spark.stop()

    env = bc.machine()
    lines = [
        "# Commits inside an epoch",
        "",
        f"`python benchmarks/commit_cost.py --rows {args.rows} --repeats {args.repeats}` on "
        f"{time.strftime('%Y-%m-%d')}: {env['cpu']}, {env['cores']} cores. {args.rows:,} rows, "
        f"{args.epochs} epochs, {steps} steps an epoch, 2 processes on local[2]; the longest "
        "rank's training seconds (best of the runs; all runs in brackets), and per run the "
        "share of it rank 0 spent committing.",
        "",
        "| commit_every_steps | commits | training s | rank 0 in commits, of training |",
        "|---|---:|---:|---:|",
    ]
    for name, _ in settings:
        runs = ", ".join(f"{s:.2f}" for s in seconds[name])
        shares = ", ".join(f"{s:.1%}" for s in spent[name])
        best = min(seconds[name])
        lines.append(f"| {name} | {made[name]} | {best:.2f} ({runs}) | {shares} |")
    out = bc.RESULTS / "commit_cost.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
