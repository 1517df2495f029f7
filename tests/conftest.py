"""Shared fixtures: one real Spark session at a time (local[4] or local-cluster), data."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
import torch
from pyspark import SparkContext
from pyspark import cloudpickle as pyspark_cloudpickle
from pyspark.ml.linalg import Vectors
from pyspark.sql import SparkSession

from spark_estimator import Store, TorchEstimator
from tests.jvm_archive import java_options

# Executors must run this interpreter (the test venv), not whatever python3 is on PATH.
os.environ["PYSPARK_PYTHON"] = sys.executable
# Every JVM the tests start through spark-submit (this process's Spark, and the spark-submit
# jobs, notebooks and scripts run as subprocesses) lives for seconds to minutes: compiling
# with C1 only, and the serial collector, spend about a third less CPU starting it, and the
# class-data archive that the README's test command builds (``tests.jvm_archive``) about
# as much again.
os.environ.setdefault("SPARK_SUBMIT_OPTS", java_options())
# Inherited by every process this pytest process starts (its Spark's executors and their
# Python workers, ranks, decode workers): ``tests.processes`` tells them from another
# pytest worker's, which runs beside this one in the suite.
os.environ["SPARK_ESTIMATOR_TEST_PROCESS"] = str(os.getpid())

LOCAL = "local[4]"
CLUSTER = "local-cluster[2,1,1024]"
_current: dict[str, SparkSession] = {}
_conf_keys: dict[str, list[str]] = {}  # the conf each master's session was given


def spark_session(master: str, **conf: str) -> SparkSession:
    """The session for ``master``, stopping a session of another master first.

    A process has one SparkContext at a time, so every test gets its session here: ``conf``
    (Spark settings, ``**{"spark.x": "v"}``) applies when the session is created, and a
    session of a master that goes away (a cluster a test started, see tests/clusters.py) is
    ended with ``stop_session``; the next test's fixture then starts its own again."""
    if master in _current:
        return _current[master]
    for other in list(_current):
        stop_session(other)
    builder = (
        SparkSession.builder.master(master)
        .appName("spark-estimator tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.driver.memory", "2g")
    )
    if not master.startswith("local["):  # executors of their own, started as ours
        builder = builder.config("spark.executor.extraJavaOptions", java_options())
    for key, value in conf.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    # getOrCreate returns a running session whatever its master: none may run here
    assert session.sparkContext.master == master, session.sparkContext.master
    session.sparkContext.setLogLevel("ERROR")
    _current[master] = session
    _conf_keys[master] = list(conf)
    return session


def stop_session(master: str) -> None:
    """Stop the session of ``master``, if one runs, and forget its ``conf``: Spark keeps a
    session's settings as the JVM's system properties, which the next session would
    inherit (a driver address on a bridge a cluster took down with it)."""
    if master in _current:
        _current.pop(master).stop()
        system = SparkContext._jvm.java.lang.System
        for key in _conf_keys.pop(master, []):
            system.clearProperty(key)


def pytest_collection_modifyitems(items):
    """Run the local-cluster tests last (in two xdist workers: each file's last), so the JVM
    is switched rarely; ship test code by value.

    Test modules are not importable in Spark's Python workers, so functions and classes
    defined in them are pickled by value, as user code in ``__main__`` or a notebook is.
    """
    from tests import faults

    items.sort(key=lambda item: item.get_closest_marker("cluster") is not None)
    for module in {item.module for item in items} | {faults}:
        cloudpickle.register_pickle_by_value(module)
        pyspark_cloudpickle.register_pickle_by_value(module)


def pytest_sessionfinish(session, exitstatus):
    for s in _current.values():
        s.stop()


@pytest.fixture
def spark() -> SparkSession:
    return spark_session(LOCAL)


@pytest.fixture
def cluster_spark() -> SparkSession:
    return spark_session(CLUSTER)


@pytest.fixture
def mlflow_tracking(tmp_path, monkeypatch):
    """MLflow logging into a folder of this test (a file store: no database server here);
    the client to read it back."""
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path / 'mlruns'}"
    mlflow.set_tracking_uri(uri)
    yield mlflow.tracking.MlflowClient(uri)
    mlflow.set_tracking_uri(None)


@pytest.fixture
def store(tmp_path) -> Store:
    return Store.create(str(tmp_path / "store"))


@pytest.fixture
def spy(monkeypatch):
    """``spy(module, name)`` wraps the driver function ``module.name`` so that it still runs,
    and returns the list its calls append their results to."""

    def install(module, name: str) -> list:
        results, real = [], getattr(module, name)

        def wrapper(*args, **kwargs):
            results.append(real(*args, **kwargs))
            return results[-1]

        monkeypatch.setattr(module, name, wrapper)
        return results

    return install


def digits_rows(limit: int | None = None):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = digits.data[:limit] / 16.0, digits.target[:limit]
    return [(Vectors.dense(row), int(label)) for row, label in zip(x, y)]


@pytest.fixture
def digits_df(spark):
    return spark.createDataFrame(digits_rows(), ["features", "label"])


def regression_rows(n: int = 200, seed: int = 0):
    """y = x . w + 0.5 with 3 features, as (array features, double label, row id)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3))
    y = x @ np.array([1.5, -2.0, 0.7]) + 0.5
    return [(row.tolist(), float(t), i) for i, (row, t) in enumerate(zip(x, y))]


@pytest.fixture
def regression_df(spark):
    return spark.createDataFrame(regression_rows(), "x array<double>, y double, id long")


def linear_net(inputs: int = 3, outputs: int = 1, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(inputs, outputs)


def cnn(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 64, 10),
    )


def make_estimator(net=None, store=None, **params) -> TorchEstimator:
    """A small regression estimator (features 'x', label 'y'); ``params`` override."""
    net = net if net is not None else linear_net()
    base = dict(
        model=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["y"],
        batch_size=16,
        epochs=3,
        num_proc=2,
        store=store,
        use_gpu=False,
    )
    base.update(params)
    return TorchEstimator(**base)


def write_id_dataset(root, file_rows: list[int], row_group_size: int, split: str = "train"):
    """Parquet files under ``root/split`` whose rows are ids 0.. in file order, with a
    2-wide float array feature ``x`` = [id, -id] and an int64 label ``y`` = id; returns the
    DatasetInfo describing them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from spark_estimator.shared.spec import ColumnSpec, DatasetInfo

    folder = root / split
    folder.mkdir(parents=True, exist_ok=True)
    files, start = [], 0
    for i, rows in enumerate(file_rows):
        ids = list(range(start, start + rows))
        start += rows
        table = pa.table(
            {
                "x": pa.array([[float(v), -float(v)] for v in ids], pa.list_(pa.float32())),
                "y": pa.array(ids, pa.int64()),
            }
        )
        path = folder / f"part-{i:05d}.parquet"
        pq.write_table(table, path, row_group_size=row_group_size)
        meta = pq.ParquetFile(path).metadata
        files.append(
            (
                f"{split}/{path.name}",
                [meta.row_group(g).num_rows for g in range(meta.num_row_groups)],
            )
        )
    return DatasetInfo(
        path=str(root),
        features=[ColumnSpec("x", "array", "float32")],
        labels=[ColumnSpec("y", "scalar", "int64")],
        files={split: files},
    )


@pytest.fixture
def process_group(tmp_path):
    """A real one-process gloo group in this process, for unit tests of collectives."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "pg-store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_user_script(folder: Path, source: str) -> subprocess.CompletedProcess:
    """``source`` run as a user runs a script (``python script.py``, this checkout
    importable), in ``folder``: what its terminal would show, as stdout and stderr."""
    (folder / "script.py").write_text(source)
    root = Path(__file__).resolve().parents[1]
    return subprocess.run(
        [sys.executable, "script.py"],
        env={**os.environ, "PYTHONPATH": str(root)},
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=600,
    )
