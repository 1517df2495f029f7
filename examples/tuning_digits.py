"""Tune the digits CNN's learning rate and width with an Optuna study of Spark fits.

Needs Optuna, which `./dev.sh demo` does not install: `.venv/bin/pip install -e '.[tune]'`.
Run it with:
    PYSPARK_PYTHON=.venv/bin/python .venv/bin/spark-submit --master "local[2]" \
        examples/tuning_digits.py

Every trial is one fit of a small CNN on scikit-learn's digits (its learning rate drawn
log-uniformly from 1e-4 to 1e-1, its width from {8, 16, 32}); two trials train at once
(one process each on local[2]'s two slots). After every epoch a trial's validation loss
goes to Optuna's MedianPruner, which stops trials that do worse than the median of the
earlier ones at the same epoch. The driver prints one line per trial as it ends, then the
trials, the epochs pruning saved, and the best model's accuracy on held-out images.

The study is kept in the store (an Optuna journal file, `studies/<study name>.journal`)
under `--study-name`: run the script again with the same `--store` and it resumes the
study, taking up the trials a killed run left running from their checkpoints and asking
new trials until the study holds `--trials` (a study already complete trains nothing and
gives its best model again). A new `--study-name` or `--store` starts a new study.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile

import optuna
import torch
from pyspark.ml.linalg import Vectors
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from sklearn.datasets import load_digits

from spark_estimator import Store, TorchEstimator
from spark_estimator.tuning import OptunaSearch


def spark_session(app_name: str) -> SparkSession:
    builder = SparkSession.builder.appName(app_name).config("spark.ui.showConsoleProgress", "false")
    if "PYSPARK_GATEWAY_PORT" not in os.environ:  # run as a plain script: pick a master
        builder = builder.master(os.environ.get("SPARK_MASTER", "local[2]"))
    return builder.getOrCreate()


def digits_frame(spark: SparkSession):
    digits = load_digits()
    rows = [(Vectors.dense(x), int(y)) for x, y in zip(digits.data / 16.0, digits.target)]
    return spark.createDataFrame(rows, ["features", "label"])


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


def space(trial: optuna.Trial) -> dict:
    """A trial's params: the learning rate, and the model built (on each process) at the
    trial's width."""
    width = trial.suggest_categorical("width", [8, 16, 32])
    return {
        "learning_rate": trial.suggest_float("lr", 1e-4, 1e-1, log=True),
        "model": functools.partial(make_net, width),
    }


def held_trials(store: Store, study_name: str) -> int:
    """The trials the study holds already in the store (0 for a new study)."""
    if not store.exists(store.study_journal(study_name)):
        return 0
    backend = optuna.storages.journal.JournalFileBackend(store.study_journal(study_name))
    study = optuna.load_study(
        study_name=study_name, storage=optuna.storages.JournalStorage(backend)
    )
    return len(study.trials)


def accuracy(predictions) -> float:
    predicted_class = F.expr("array_position(prediction, array_max(prediction)) - 1")
    correct = (predicted_class == F.col("label")).cast("double")
    return predictions.select(F.avg(correct)).first()[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--store",
        default=os.path.join(tempfile.gettempdir(), "spark-estimator-tuning"),
        help="store folder (default: %(default)s)",
    )
    parser.add_argument(
        "--study-name", default="tuning-digits", help="the study in the store (%(default)s)"
    )
    parser.add_argument("--trials", type=int, default=10, help="trials in the study in all")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--parallelism", type=int, default=2, help="trials at once")
    parser.add_argument("--num-proc", type=int, default=1, help="processes per trial")
    args = parser.parse_args(argv)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = spark_session("spark-estimator tuning demo")
    spark.sparkContext.setLogLevel("ERROR")
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the search prints its own lines

    train, test = digits_frame(spark).randomSplit([0.8, 0.2], seed=7)
    estimator = TorchEstimator(
        model=functools.partial(make_net, 16),  # each trial's space replaces it
        optimizer=torch.optim.Adam,  # built on each process, at the trial's learning_rate
        loss=torch.nn.CrossEntropyLoss(),
        feature_cols=["features"],
        label_cols=["label"],
        input_shapes=[[-1, 1, 8, 8]],
        batch_size=32,
        epochs=args.epochs,
        num_proc=args.num_proc,
        validation=0.2,
        random_seed=42,
        store=Store.create(args.store),
        metrics={"accuracy": lambda logits, label: (logits.argmax(1) == label).float().mean()},
    )
    search = OptunaSearch(
        estimator=estimator,
        space=space,
        metric="validation.loss",
        n_trials=args.trials,
        parallelism=args.parallelism,
        seed=0,
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=2),
        storage="store",  # the study in the store: running the script again resumes it
        study_name=args.study_name,
    )
    held = held_trials(estimator.getStore(), args.study_name)
    if held:
        print(f"resuming study {args.study_name!r}: {held} trial(s) in the store already")
    model = search.fit(train)

    trials = model.trials_dataframe()
    print(
        "\n"
        + trials[["number", "state", "epochs", "value", "params_lr", "params_width"]].to_string(
            index=False, float_format=lambda v: f"{v:.4g}"
        )
    )
    trained = int(trials["epochs"].fillna(0).sum())
    print(
        f"\n{trained} epochs trained in {len(trials)} trials; without pruning: "
        f"{len(trials) * args.epochs}"
    )
    best = model.bestParams
    print(
        f"best trial {model.bestTrial.number}: lr={best['lr']:.3g} width={best['width']} "
        f"validation loss {model.bestValue:.4f}"
    )
    held_out = accuracy(model.transform(test))
    print(f"held-out accuracy of the best model: {held_out:.3f} on {test.count()} images")
    spark.stop()
    return 0 if held_out >= 0.85 else 1


if __name__ == "__main__":
    sys.exit(main())
