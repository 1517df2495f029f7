"""A driver of an OptunaSearch study, run by tests/test_tuning.py in a process of its own so
that the test can kill it (SIGKILL of its whole process group: the driver, its JVM and the
ranks, as a lost driver machine leaves a study) and start another driver of the same study.

Each run opens the study ``--study`` kept in the store (``storage="store"``) and runs it
to ``--trials`` trials of a small regression fit (``tests.conftest.make_estimator``,
``--epochs`` epochs, 2 processes on local[4], TPE seeded 0, one trial at a time); the
rows are ``spark.createDataFrame`` of a list (``--data rows``) or Parquet files read with
``spark.read.parquet`` (``--data parquet``, written by the first run). The driver kills
itself, to leave the study as a killed driver leaves it:

- ``--kill-at-report T:E``: when trial T reports epoch E (its fit mid-trial, the epochs
  before checkpointed);
- ``--kill-at-tell T``: when trial T's fit ended and the tuner records it (its run done,
  the trial not told).

``--prune T:E`` prunes trial T at epoch E; ``--median`` uses
``MedianPruner(n_startup_trials=1, n_warmup_steps=2)`` (else nothing is pruned). The
trials' lines go to stderr. Usage: ``python tests/tuning_driver.py <store> [options]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

os.environ["PYSPARK_PYTHON"] = sys.executable
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optuna  # noqa: E402

from spark_estimator import Store  # noqa: E402
from spark_estimator.tuning import OptunaSearch  # noqa: E402
from tests.conftest import LOCAL, make_estimator, regression_rows, spark_session  # noqa: E402

SCHEMA = "x array<double>, y double, id long"


def die() -> None:
    """SIGKILL this driver's process group (started in a session of its own by the test)."""
    os.killpg(os.getpgid(0), signal.SIGKILL)


class Pruner(optuna.pruners.BasePruner):
    """``inner``'s answers, except: prunes trial ``prune[0]`` at epoch ``prune[1]``; kills
    the driver when trial ``kill[0]`` reports epoch ``kill[1]``."""

    def __init__(self, inner, prune=None, kill=None):
        self.inner, self.prune_at, self.kill_at = inner, prune, kill

    def prune(self, study, trial) -> bool:
        at = (trial.number, trial.last_step)
        if at == self.kill_at:
            die()
        if at == self.prune_at:
            return True
        return self.inner.prune(study, trial)


def pair(text: str | None) -> tuple[int, int] | None:
    return tuple(int(v) for v in text.split(":")) if text else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("--study", default="killed")
    parser.add_argument("--data", choices=("rows", "parquet"), default="rows")
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--kill-at-report")
    parser.add_argument("--kill-at-tell", type=int)
    parser.add_argument("--prune")
    parser.add_argument("--median", action="store_true")
    args = parser.parse_args()

    spark = spark_session(LOCAL)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if args.data == "rows":
        df = spark.createDataFrame(regression_rows(), SCHEMA)
    else:
        path = str(Path(args.store).parent / "rows.parquet")
        if not Path(path).exists():
            spark.createDataFrame(regression_rows(), SCHEMA).write.parquet(path)
        df = spark.read.parquet(path)
    if args.kill_at_tell is not None:
        tell = optuna.Study.tell

        def tell_or_die(study, trial, *a, **k):
            number = trial if isinstance(trial, int) else trial.number
            if number == args.kill_at_tell:
                die()
            return tell(study, trial, *a, **k)

        optuna.Study.tell = tell_or_die
    inner = (
        optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=2)
        if args.median
        else optuna.pruners.NopPruner()
    )
    est = make_estimator(
        store=Store.create(args.store), validation=0.25, epochs=args.epochs, max_restarts=0
    )
    search = OptunaSearch(
        estimator=est,
        space=lambda t: {"learning_rate": t.suggest_float("lr", 1e-3, 0.3, log=True)},
        n_trials=args.trials,
        seed=0,
        storage="store",
        study_name=args.study,
        pruner=Pruner(inner, pair(args.prune), pair(args.kill_at_report)),
    )
    model = search.fit(df)
    print(model.trials_dataframe().to_string(), flush=True)


if __name__ == "__main__":
    main()
