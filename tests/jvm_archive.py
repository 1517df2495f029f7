"""A class-data sharing archive of Spark's driver JVM, for the tests' JVMs to start from.

Most of the suite's CPU goes into starting processes: every spark-submit job, notebook,
script and ``spark-estimator-run`` a test starts brings up a driver JVM, which spends about
5 CPU seconds loading and verifying Spark's classes (C1 only, see ``tests.conftest``). With
an archive of those classes (``-Xshare:dump`` of the classes a small session loads) a JVM
maps them instead: measured here, a local session with a Parquet write and read took 6.4
CPU seconds instead of 11.1.

``python -m tests.jvm_archive`` builds it once per virtual environment (the README's test
command does, about a minute, for each of its two), into the environment's ``spark-cds/``
under a name of the Java version, the jars and this recipe. Where it exists,
``java_options()`` names it: ``tests.conftest`` hands them to every driver JVM through
``SPARK_SUBMIT_OPTS`` and to the executors of every session with executors of its own
(local-cluster, standalone), ``tests.clusters`` to its Masters and Workers (all of them
started with the driver's class path).
A JVM whose class path did not match would start as it does without it, silently.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pyspark

SPARK_HOME = Path(pyspark.__file__).resolve().parent
FOLDER = Path(sys.prefix) / "spark-cds"
BASE_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"  # what every test JVM gets

# a session doing what the tests' sessions do: a DataFrame from Python rows, Parquet
# written and read, a barrier mapInArrow job through a Python worker; it prints its JVM's
# class path, as spark-submit built it
SESSION = """
    import os
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.master("local[2]").getOrCreate()
    rows = [(float(i), [1.0, 2.0], i) for i in range(100)]
    df = spark.createDataFrame(rows, "y double, x array<double>, id long")
    df.write.mode("overwrite").parquet(os.environ["OUT"])
    back = spark.read.parquet(os.environ["OUT"]).repartition(2)
    back.mapInArrow(lambda batches: batches, back.schema, barrier=True).count()
    jvm = spark.sparkContext._jvm
    print("CLASSPATH=" + jvm.java.lang.System.getProperty("java.class.path"))
    spark.stop()
"""


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    return str(Path(home) / "bin" / "java") if home else "java"


def archive_path() -> Path:
    """Where the archive of this Java, these jars and this recipe lies (built or not)."""
    version = subprocess.run(
        [_java(), "-version"], capture_output=True, text=True, check=True
    ).stderr
    jars = sorted((SPARK_HOME / "jars").glob("*.jar"))
    key = hashlib.sha256(f"{version} {BASE_OPTS} {SESSION}".encode())
    for jar in jars:
        key.update(f"{jar.name} {jar.stat().st_size} {jar.stat().st_mtime_ns}".encode())
    return FOLDER / f"driver-{key.hexdigest()[:16]}.jsa"


@functools.cache
def java_options() -> str:
    """The options of every test JVM started through spark-submit: with the archive where
    it was built."""
    path = archive_path()
    if not path.is_file():
        return BASE_OPTS
    return f"{BASE_OPTS} -XX:SharedArchiveFile={path} -Xlog:cds=off -Xlog:cds+dynamic=off"


def build() -> Path:
    """The archive, built unless it is there."""
    path = archive_path()
    if path.is_file():
        return path
    started = time.monotonic()
    print("building a class-data archive of Spark's driver JVM for the tests (once a venv)...")
    FOLDER.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        classes = Path(work) / "classes.lst"
        env = dict(
            os.environ,
            OUT=str(Path(work) / "table"),
            PYSPARK_PYTHON=sys.executable,
            SPARK_SUBMIT_OPTS=f"{BASE_OPTS} -XX:DumpLoadedClassList={classes}",
        )
        run = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(SESSION)],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if run.returncode != 0:
            raise RuntimeError(f"the class list's session failed:\n{run.stderr[-3000:]}")
        classpath = run.stdout.split("CLASSPATH=", 1)[1].splitlines()[0]
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        dump = subprocess.run(
            [
                _java(), "-Xshare:dump", f"-XX:SharedClassListFile={classes}",
                f"-XX:SharedArchiveFile={partial}", *BASE_OPTS.split(), "-cp", classpath,
            ],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if dump.returncode != 0 or not partial.is_file():
            partial.unlink(missing_ok=True)
            raise RuntimeError(f"the archive's dump failed:\n{dump.stdout[-3000:]}")
        partial.replace(path)  # whole or not at all, for a run started meanwhile
    print(f"built {path} in {time.monotonic() - started:.0f} s")
    return path


if __name__ == "__main__":
    build()
