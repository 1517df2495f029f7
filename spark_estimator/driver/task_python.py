"""Driver: the Python interpreter Spark's tasks run, chosen and checked before any job.

PySpark starts the tasks' Python as ``SparkContext.pythonExec``, read once from
``PYSPARK_PYTHON`` (else ``python3`` from the PATH) when the context starts; a
``spark.pyspark.python`` given to ``SparkSession.builder`` is only honoured by
``spark-submit``. So a program run with the virtual environment's ``.venv/bin/python``, the
environment not active, would have its tasks run another Python, without torch or
spark-estimator. ``use_task_python`` decides it instead, for every job that follows:
``spark.pyspark.python`` when set, else ``PYSPARK_PYTHON``, else, on this machine's
masters (``local``, ``local-cluster``), the driver's own interpreter; on a cluster,
Spark's ``python3``. ``check_task_python`` then runs one tiny task, where the driver's
interpreter is not known to be the tasks', to see that it can import what training needs.
"""

from __future__ import annotations

import os
import re
import sys

from .launch import is_connect

# what a training task imports, in the order they are tried
NEEDED = ("pyarrow", "torch", "spark_estimator")
HOW_TO_SET = (
    "Set spark.pyspark.python (SparkSession.builder.config('spark.pyspark.python', ...) or "
    "spark-submit --conf) or the PYSPARK_PYTHON environment variable to a Python that has "
    "torch and spark-estimator installed, at the same path on every executor"
)
_checked: set[tuple[str, str]] = set()  # (application id, interpreter) found to work


def chosen_python(master: str, configured: str | None, environment: str | None) -> str | None:
    """The interpreter the tasks should run, from ``spark.pyspark.python`` (``configured``)
    and ``PYSPARK_PYTHON`` (``environment``); None to keep Spark's default."""
    if configured:
        return configured
    if environment:
        return environment
    if master.startswith("local"):
        return sys.executable
    return None


def use_task_python(spark) -> str | None:
    """Make the jobs of ``spark`` run the interpreter ``chosen_python`` picks; return the
    one they run (None on Spark Connect: the server decides)."""
    if is_connect(spark):
        return None
    sc = spark.sparkContext
    chosen = chosen_python(
        sc.master, sc.getConf().get("spark.pyspark.python"), os.environ.get("PYSPARK_PYTHON")
    )
    if chosen is not None:
        sc.pythonExec = chosen  # read each time a Python function is shipped
    return sc.pythonExec


def local_python(spark) -> bool:
    """Whether ``spark``'s tasks run on this machine with the driver's own interpreter (a
    local master whose chosen Python is this one): what imports here imports there."""
    if is_connect(spark):
        return False
    sc = spark.sparkContext
    if not sc.master.startswith("local"):
        return False
    chosen = chosen_python(
        sc.master, sc.getConf().get("spark.pyspark.python"), os.environ.get("PYSPARK_PYTHON")
    )
    return chosen is not None and os.path.realpath(chosen) == os.path.realpath(sys.executable)


def _probe_function():
    """The function of the checking task: each module of ``NEEDED`` its Python cannot
    import, and why. Made here, so that it is pickled by value: the task must not need
    spark_estimator to load it."""

    def probe(_):
        import importlib
        import sys

        missing = []
        for name in NEEDED:
            try:
                importlib.import_module(name)
            except Exception as e:
                missing.append(f"{name} ({type(e).__name__}: {e})")
        return [(sys.executable, missing)]

    return probe


def _spark_reason(error: BaseException) -> str:
    """The line of a failed task's error that says why (e.g. PYTHON_VERSION_MISMATCH)."""
    text = str(error)
    for pattern in (r"\[PYTHON_VERSION_MISMATCH\][^\n]*", r"\w+(?:Error|Exception): [^\n]*"):
        found = re.search(pattern, text)
        if found:
            return found.group(0).strip()
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__


def check_task_python(spark) -> None:
    """Choose the tasks' interpreter (``use_task_python``) and, unless it is the driver's
    own on this machine's masters, or was already found to work in this application, run one task
    that imports pyarrow, torch and spark_estimator. Raises a RuntimeError naming the
    interpreter, what it lacks and how to set another, before any training job."""
    python = use_task_python(spark)
    if python is None:
        return
    sc = spark.sparkContext
    key = (sc.applicationId, python)
    if key in _checked or (sc.master.startswith("local") and python == sys.executable):
        return  # this machine's masters run the driver's interpreter, which has them
    sc.setJobDescription("spark-estimator: check the tasks' Python")
    try:
        [(executable, missing)] = sc.parallelize([0], 1).mapPartitions(_probe_function()).collect()
    except Exception as e:
        raise RuntimeError(
            f"spark.pyspark.python: the tasks' Python, {python}, could not run a task: "
            f"{_spark_reason(e)}.\n{HOW_TO_SET}."
        ) from None
    finally:
        sc.setJobDescription(None)
    if missing:
        where = "" if executable == python else f" ({executable} on the executor)"
        raise RuntimeError(
            f"spark.pyspark.python: the tasks' Python, {python}{where}, cannot import "
            f"{', '.join(missing)}.\n{HOW_TO_SET}."
        )
    _checked.add(key)
