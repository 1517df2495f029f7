"""OptunaSearch: what pruning saves, what parallel trials save, the tuner's own cost, and
the best value against a grid search with the same number of fits.

A hand-run benchmark, not a test. The job: the digits CNN of examples/tuning_digits.py
(scikit-learn's 1,797 8x8 images as one ML Vector column, 20% of them validation,
``random_seed=42``; two 3x3 convolutions of ``width`` channels, max-pooling, a linear layer;
Adam, cross-entropy, batch 32) tuned for its validation loss over the search space of the
issue: the learning rate log-uniform over 5 decades (1e-5 to 1), the width in {16, 32, 64};
``--trials`` trials (16) of ``--epochs`` epochs (8) each, ``--num-proc`` processes per trial
(1), on ``--master`` (``local[2]``: the slots of this 2-core machine; on a larger one give
``local[N]``, and ``--parallelism`` the trials at once). Side by side in one run, each search
on its own new store, a TPESampler seeded 0:

(a) no pruning (``NopPruner``), trials one at a time (``parallelism=1``);
(b) no pruning, ``--parallelism`` (2) trials at once;
(c) ``SuccessiveHalvingPruner()`` (Optuna's defaults: rungs at 1, 4 and 16 epochs, a
    quarter promoted), one at a time;
(d) the same pruner, ``--parallelism`` at once;
(e) the grid: the estimator's ``fitMultiple`` over a ``ParamGridBuilder`` of 5 learning
    rates (1e-5, 1e-4, 1e-3, 1e-2, 1e-1) x the 3 widths, 15 fits (a 16-point grid of this
    space has no even shape; 15 is the nearest), each fit's value its last validation loss,
    as ``TrainValidationSplit`` and ``CrossValidator`` fit a grid (one fit per point here,
    no folds, the value the same metric the searches optimize).

Numbers, each from the searches' own records:

- epochs trained with pruning / without: the sum of the trials' ``epochs`` of (c) over
  (a)'s (target <= 0.5);
- wall time with parallelism / without: (b) over (a), the same trials' work at once
  (target <= 0.6 where the slots hold both); (d) over (c) is shown too, though its trials
  and prunings differ from (c)'s;
- the driver's overhead per trial beyond its fit: each trial's ``duration_s`` (from its
  ask to its tell, on the driver) less its ``fit_seconds`` (the fit's own clock, from
  validation to the built model), median and largest over the trials of (a) and (c)
  (target <= 0.5 s);
- the pruning round trip: per reported epoch of (c), the seconds from rank 0's report file
  to the tuner's answer file (their modification times), median and largest;
- the best validation loss of each search and of the grid.

Before the timed runs one untimed fit starts Spark's Python workers and imports torch in
them; before each search the script waits (up to ``--quiet-timeout``) for other processes
to leave the CPUs idle, so run it on a quiet machine. Results are printed and written to
``benchmarks/results/tuning.md`` (a run smaller than the full job writes to a temporary
folder instead; ``--no-record`` writes nothing).

Run from the repository root::

    .venv/bin/python benchmarks/tuning.py                                   # ~5 min here
    .venv/bin/python benchmarks/tuning.py --trials 4 --epochs 2 --no-record  # smoke run
"""

from __future__ import annotations

import argparse
import functools
import glob
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402
import torch  # noqa: E402

FULL_TRIALS, FULL_EPOCHS = 16, 8
WIDTHS = (16, 32, 64)
GRID_LRS = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
EPOCH_TARGET, WALL_TARGET, OVERHEAD_TARGET = 0.5, 0.6, 0.5
HEADER = """\
# Tuning (benchmarks/tuning.py)

`OptunaSearch` over the digits CNN (learning rate log-uniform 1e-5 to 1, width in
{16, 32, 64}, TPE seeded 0): epochs trained with a `SuccessiveHalvingPruner` against none, wall time
with trials at once against one at a time, the driver's own seconds per trial, the pruning
round trip per epoch, and the best validation loss against a grid of the same space fitted
with `fitMultiple`. How each number is obtained: the script's docstring.
"""


def make_net(width: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, width, kernel_size=3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(width, width, kernel_size=3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(width * 4 * 4, 10),
    )


def space(trial) -> dict:
    width = trial.suggest_categorical("width", list(WIDTHS))
    return {
        "learning_rate": trial.suggest_float("lr", 1e-5, 1.0, log=True),
        "model": functools.partial(make_net, width),
    }


def digits(spark):
    from pyspark.ml.linalg import Vectors
    from sklearn.datasets import load_digits

    data = load_digits()
    rows = [(Vectors.dense(x), int(y)) for x, y in zip(data.data / 16.0, data.target)]
    return spark.createDataFrame(rows, ["features", "label"])


def estimator(store, epochs: int, num_proc: int):
    from spark_estimator import TorchEstimator

    return TorchEstimator(
        model=functools.partial(make_net, 16),
        optimizer=torch.optim.Adam,
        loss=torch.nn.CrossEntropyLoss(),
        feature_cols=["features"],
        label_cols=["label"],
        input_shapes=[[-1, 1, 8, 8]],
        batch_size=32,
        epochs=epochs,
        num_proc=num_proc,
        validation=0.2,
        random_seed=42,
        store=store,
        use_gpu=False,
        verbose=False,
    )


def search(df, args, pruner, parallelism: int) -> dict:
    """One study on a new store: its trials (``trials_dataframe``), wall time, best value
    and pruning round trips."""
    import optuna

    from spark_estimator import Store
    from spark_estimator.tuning import OptunaSearch

    bc.wait_quiet(args.quiet_timeout)
    with tempfile.TemporaryDirectory(dir=args.store_dir) as folder:
        store = Store.create(folder)
        tuner = OptunaSearch(
            estimator=estimator(store, args.epochs, args.num_proc),
            space=space,
            n_trials=args.trials,
            parallelism=parallelism,
            sampler=optuna.samplers.TPESampler(seed=0),
            pruner=pruner,
            verbose=False,
        )
        start = time.perf_counter()
        model = tuner.fit(df)
        wall = time.perf_counter() - start
        trips = []
        for report in glob.glob(os.path.join(folder, "runs", "*", "trial", "epoch-*.json")):
            answer = report.replace("epoch-", "answer-")
            if os.path.exists(answer):
                trips.append(os.path.getmtime(answer) - os.path.getmtime(report))
    frame = model.trials_dataframe()
    frame["overhead_s"] = frame["duration_s"] - frame["fit_seconds"]
    return {"frame": frame, "wall": wall, "best": model.bestValue, "trips": trips}


def grid(df, args) -> dict:
    """The grid's fits (``fitMultiple``), one after the other on a new store."""
    from pyspark.ml.tuning import ParamGridBuilder

    from spark_estimator import Store

    bc.wait_quiet(args.quiet_timeout)
    with tempfile.TemporaryDirectory(dir=args.store_dir) as folder:
        est = estimator(Store.create(folder), args.epochs, args.num_proc)
        points = (
            ParamGridBuilder()
            .addGrid(est.learning_rate, list(GRID_LRS))
            .addGrid(est.model, [functools.partial(make_net, w) for w in WIDTHS])
            .build()
        )
        start = time.perf_counter()
        values = [
            model.getHistory()[-1]["validation"]["loss"] for _, model in est.fitMultiple(df, points)
        ]
        wall = time.perf_counter() - start
    finite = [v for v in values if v == v]
    return {"fits": len(values), "wall": wall, "best": min(finite) if finite else float("nan")}


def spread(values) -> str:
    values = [v for v in values if v == v]
    if not values:
        return "-"
    return f"{statistics.median(values):.3f} (largest {max(values):.3f})"


def verdict(value: float, target: float) -> str:
    return "met" if value <= target else "**missed**"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=FULL_TRIALS)
    parser.add_argument("--epochs", type=int, default=FULL_EPOCHS)
    parser.add_argument("--parallelism", type=int, default=2, help="trials at once in (b), (d)")
    parser.add_argument("--num-proc", type=int, default=1, help="processes per trial")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--store-dir", default=tempfile.gettempdir(), help="where stores go")
    parser.add_argument("--quiet-timeout", type=float, default=60.0)
    bc.add_record_args(parser)
    args = parser.parse_args()

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spark = bc.spark_session(args.master)
    df = digits(spark).cache()
    df.count()
    env = bc.machine(("optuna",))
    print(f"{args.trials} trials x {args.epochs} epochs on {args.master}; {env['cpu']}", flush=True)

    from spark_estimator import Store

    with tempfile.TemporaryDirectory(dir=args.store_dir) as folder:  # Python workers, torch
        estimator(Store.create(folder), 1, args.num_proc).fit(df)

    nop, halving = optuna.pruners.NopPruner, optuna.pruners.SuccessiveHalvingPruner
    runs = {}
    for name, pruner, parallelism in (
        ("a", nop(), 1),
        ("b", nop(), args.parallelism),
        ("c", halving(), 1),
        ("d", halving(), args.parallelism),
    ):
        runs[name] = search(df, args, pruner, parallelism)
        frame = runs[name]["frame"]
        print(
            f"({name}) {type(pruner).__name__}, parallelism {parallelism}: "
            f"{runs[name]['wall']:.1f} s, {int(frame['epochs'].fillna(0).sum())} epochs, "
            f"states {frame['state'].value_counts().to_dict()}, best {runs[name]['best']:.4f}",
            flush=True,
        )
    runs["e"] = grid(df, args)
    grid_run = runs["e"]
    print(
        f"(e) grid: {grid_run['fits']} fits, {grid_run['wall']:.1f} s, best {grid_run['best']:.4f}"
    )

    epochs = {k: runs[k]["frame"]["epochs"].fillna(0).sum() for k in "abcd"}
    epoch_ratio = epochs["c"] / epochs["a"]
    wall_ratio = runs["b"]["wall"] / runs["a"]["wall"]
    pruned_wall_ratio = runs["d"]["wall"] / runs["c"]["wall"]
    overheads = [*runs["a"]["frame"]["overhead_s"], *runs["c"]["frame"]["overhead_s"]]
    worst = max(v for v in overheads if v == v)
    lines = [
        f"## {env['date']}",
        "",
        *bc.machine_lines(env, ("optuna",)),
        f"- Job: {args.trials} trials x {args.epochs} epochs, {args.num_proc} process(es) per "
        f"trial on `{args.master}`, parallelism {args.parallelism} in (b) and (d)",
        "",
        "| search | wall s | epochs trained | complete / pruned / failed | best validation loss |",
        "|---|---|---|---|---|",
    ]
    names = {
        "a": "(a) no pruning, one at a time",
        "b": f"(b) no pruning, {args.parallelism} at once",
        "c": "(c) SuccessiveHalvingPruner, one at a time",
        "d": f"(d) SuccessiveHalvingPruner, {args.parallelism} at once",
    }
    for key, label in names.items():
        states = runs[key]["frame"]["state"].value_counts()
        counts = " / ".join(str(int(states.get(s, 0))) for s in ("complete", "pruned", "fail"))
        lines.append(
            f"| {label} | {runs[key]['wall']:.1f} | {int(epochs[key])} | {counts} | "
            f"{runs[key]['best']:.4f} |"
        )
    lines += [
        f"| (e) grid, {runs['e']['fits']} fits (`fitMultiple`) | {runs['e']['wall']:.1f} | "
        f"{runs['e']['fits'] * args.epochs} | {runs['e']['fits']} / 0 / 0 | "
        f"{runs['e']['best']:.4f} |",
        "",
        f"- Epochs trained with pruning / without, (c) / (a): **{epoch_ratio:.2f}** "
        f"(target <= {EPOCH_TARGET}: {verdict(epoch_ratio, EPOCH_TARGET)})",
        f"- Wall time with parallelism {args.parallelism} / 1, no pruning, (b) / (a): "
        f"**{wall_ratio:.2f}** (target <= {WALL_TARGET}: {verdict(wall_ratio, WALL_TARGET)}); "
        f"with pruning, (d) / (c): {pruned_wall_ratio:.2f}",
        f"- Driver overhead per trial beyond its fit, (a) and (c): {spread(overheads)} s "
        f"(target <= {OVERHEAD_TARGET} s: {verdict(worst, OVERHEAD_TARGET)} for the largest)",
        f"- Pruning round trip per epoch (report -> answer), (c): {spread(runs['c']['trips'])} s",
        f"- Best validation loss: search (c) {runs['c']['best']:.4f}, (a) "
        f"{runs['a']['best']:.4f}; grid {runs['e']['best']:.4f}",
        "",
    ]
    section = "\n".join(lines)
    print("\n" + section)
    full = args.trials == FULL_TRIALS and args.epochs == FULL_EPOCHS
    bc.record(args, "tuning", HEADER, section, env["venv"], full or bool(args.results_dir))
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
