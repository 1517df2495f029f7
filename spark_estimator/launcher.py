"""``spark-estimator-run``: run a training script on N barrier tasks of a Spark job.

    spark-estimator-run -np 4 [--master URL] [--conf key=value ...] [--py-files FILES]
        [--store URL] [--run-id ID] [--env K=V ...] [--verbose N] [--max-restarts N]
        [--min-np N] [--max-np N] [--elastic-timeout S]
        [--start-timeout S] [--gpu | --no-gpu] [--no-stage-level-scheduling]
        SCRIPT [script args ...]

(also ``python -m spark_estimator.launcher``). The launcher creates a SparkSession, with
``--master`` (default ``local[<np>]``: this machine, one core per rank) and every
``--conf``, adds the ``--py-files`` (``SparkContext.addPyFile``: on every rank's
``sys.path``), runs the script with ``spark_estimator.run`` in script mode (docs/horovod.md),
and prints each rank's lines as they arrive, ``[rank <r>] <line>``: the ranks' stdout on
its stdout, their stderr and logging on its stderr. It exits 0 when every rank finished;
1 when a rank failed, with that rank's error and traceback on stderr; 2 for bad arguments.
As Horovod's ``horovodrun``, ``-np`` is the number of ranks an ``hvd.elastic`` script starts
with, ``--min-np`` the fewest it goes on with after losing some, ``--max-np`` the most it
grows to when the cluster offers more slots; each resize is one line on stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from .driver.elastic import ELASTIC_TIMEOUT_S, MAX_RESTARTS
from .runner import run
from .shared.failures import TrainingError


def _pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    return key, value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spark-estimator-run",
        description="Run a (Horovod or torchrun style) training script on Spark barrier tasks.",
    )
    p.add_argument(
        "-np",
        "--num-proc",
        dest="num_proc",
        type=int,
        required=True,
        help="number of training processes (ranks) to start with",
    )
    p.add_argument("--master", help="Spark master URL (default: local[<np>])")
    p.add_argument(
        "--conf",
        type=_pair,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Spark configuration entry (repeatable)",
    )
    p.add_argument(
        "--py-files",
        default="",
        metavar="FILES",
        help="comma-separated .py, .zip or .egg files put on every rank's sys.path, as "
        "spark-submit's (the .py modules beside the script travel without it)",
    )
    p.add_argument(
        "--store",
        help="store URL for the run's folder: output, commits "
        "(default: a temporary local folder; a multi-host cluster needs a shared one)",
    )
    p.add_argument("--run-id", help="the run's folder in the store (default: a new one)")
    p.add_argument(
        "--env",
        type=_pair,
        action="append",
        default=[],
        metavar="K=V",
        help="an environment variable set on every rank (repeatable)",
    )
    p.add_argument(
        "--verbose",
        type=int,
        default=1,
        help="0 quiet, 1 the ranks' output (default), 2 also where each rank runs",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=MAX_RESTARTS,
        help="restarts of an hvd.elastic script after a lost rank",
    )
    p.add_argument(
        "--min-np",
        "--min-num-proc",
        dest="min_num_proc",
        type=int,
        default=None,
        help="an hvd.elastic script goes on with at least this many ranks after losing some "
        "(default: -np)",
    )
    p.add_argument(
        "--max-np",
        "--max-num-proc",
        dest="max_num_proc",
        type=int,
        default=None,
        help="an hvd.elastic script grows to at most this many ranks while the cluster offers "
        "more task slots (default: -np)",
    )
    p.add_argument(
        "--elastic-timeout",
        type=float,
        default=ELASTIC_TIMEOUT_S,
        help="seconds to wait for enough task slots after a lost rank",
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=None,
        help="seconds to wait for the cluster's task slots",
    )
    gpu = p.add_mutually_exclusive_group()
    gpu.add_argument(
        "--gpu",
        dest="use_gpu",
        action="store_const",
        const=True,
        default="auto",
        help="require a GPU for every rank (default: the GPU Spark assigned to each rank "
        "where the cluster has GPUs configured, else the CPU)",
    )
    gpu.add_argument(
        "--no-gpu",
        dest="use_gpu",
        action="store_const",
        const=False,
        help="train on CPU even where Spark assigns GPUs",
    )
    p.add_argument(
        "--no-stage-level-scheduling",
        dest="stage_level_scheduling",
        action="store_false",
        help="keep the cluster's task resources for the ranks, even where a task resource "
        "profile would give each one GPU and all of its executor's cores (on a cluster "
        "whose tasks get a fractional spark.task.resource.gpu.amount; docs/gpu.md)",
    )
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    return p


def _defaults(conf: dict[str, str]) -> dict[str, str]:
    """``conf`` with the launcher's defaults where it says nothing: no console progress bar
    (its lines would break the ranks'). Which Python the tasks run is ``run``'s choice, as
    for any program (``use_task_python``): this launcher's on this machine's masters,
    unless ``spark.pyspark.python`` or ``PYSPARK_PYTHON`` names another."""
    return {"spark.ui.showConsoleProgress": "false", **conf}


@contextmanager
def _resizes_shown() -> Iterator[None]:
    """``run``'s line about each restart or growth, on stderr as the launcher's own, while
    the block runs."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("spark-estimator-run: %(message)s"))
    log = logging.getLogger("spark_estimator.runner")
    level, propagate = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


def main(argv: list[str] | None = None) -> int:
    """The ``spark-estimator-run`` command: parse ``argv`` (by default the command line),
    run the script on Spark and return the exit status (0, 1 or 2, as the module says)."""
    options = parser().parse_args(argv)
    py_files = [path for path in options.py_files.split(",") if path]
    missing = [path for path in py_files if "://" not in path and not os.path.isfile(path)]
    if missing:
        print(
            f"spark-estimator-run: --py-files: no such file: {', '.join(missing)}", file=sys.stderr
        )
        return 2
    from pyspark.sql import SparkSession

    master = options.master or f"local[{max(1, options.num_proc)}]"
    builder = SparkSession.builder.appName(f"spark-estimator-run {options.script}").master(master)
    for key, value in _defaults(dict(options.conf)).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    try:
        for path in py_files:
            spark.sparkContext.addPyFile(path)
    except Exception as e:  # one Spark cannot read, before any job
        spark.stop()
        print(f"spark-estimator-run: --py-files: {e}", file=sys.stderr)
        return 2
    timeout = {} if options.start_timeout is None else {"start_timeout": options.start_timeout}
    try:
        # warnings as lines, not Python's warnings
        with _resizes_shown(), warnings.catch_warnings(record=True) as caught:
            run(
                options.script,
                args=options.args,
                num_proc=options.num_proc,
                use_gpu=options.use_gpu,
                spark=spark,
                env=dict(options.env),
                stdout=sys.stdout,
                stderr=sys.stderr,
                verbose=options.verbose,
                store=options.store,
                run_id=options.run_id,
                max_restarts=options.max_restarts,
                min_num_proc=options.min_num_proc,
                max_num_proc=options.max_num_proc,
                elastic_timeout=options.elastic_timeout,
                stage_level_scheduling=options.stage_level_scheduling,
                **timeout,
            )
        for warning in caught:
            print(f"spark-estimator-run: warning: {warning.message}", file=sys.stderr)
    except TrainingError as e:
        print(f"spark-estimator-run: rank {e.rank} failed: {e}", file=sys.stderr)
        return 1
    except (TypeError, ValueError, FileNotFoundError) as e:  # run()'s checks, before any job
        print(f"spark-estimator-run: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the job failed otherwise (e.g. a lost rank, restarts spent)
        print(f"spark-estimator-run: the job failed: {e}", file=sys.stderr)
        return 1
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
