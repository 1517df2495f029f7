"""From a fit to a REST endpoint: train, log and register with MLflow, serve, query.

Run it with either of:
    PYSPARK_PYTHON=.venv/bin/python .venv/bin/spark-submit --master "local[2]" \
        examples/mlflow_serving.py
    .venv/bin/python examples/mlflow_serving.py

Needs full MLflow (mlflow-skinny cannot serve): .venv/bin/pip install -e '.[serving]'

scikit-learn's iris flowers (150 rows, no download) train a small classifier with
``mlflow_logging=True``: the fit logs its params, metrics and the fitted model as an MLflow
Model (signature and input example included) into a local tracking store (a sqlite file in
the work folder). The model is registered as ``iris``, then served by MLflow's own
``mlflow models serve -m models:/iris/1 --env-manager local`` on a free port of 127.0.0.1,
and the held-out rows are sent to its ``/invocations`` endpoint as JSON. The answers are
checked against ``transform`` on the same rows, and the server is stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import mlflow
import numpy as np
import torch
from pyspark.sql import SparkSession
from sklearn.datasets import load_iris

from spark_estimator import Store, TorchEstimator


def spark_session(app_name: str) -> SparkSession:
    builder = SparkSession.builder.appName(app_name).config("spark.ui.showConsoleProgress", "false")
    # Under spark-submit the master comes from its --master or properties file; run as a
    # plain Python script, this picks one.
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        builder = builder.master(os.environ.get("SPARK_MASTER", "local[2]"))
    return builder.getOrCreate()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model_uri: str, port: int, log_path: str) -> subprocess.Popen:
    """``mlflow models serve`` in its own process group, once its /ping answers."""
    command = [sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri]
    command += ["--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)]
    print("serving:", " ".join(command[1:]).replace("-m mlflow", "mlflow", 1))
    # the server runs `uvicorn` from PATH: this Python's, and MLflow's tracking URI to
    # resolve models:/ URIs
    env = {
        **os.environ,
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        "MLFLOW_TRACKING_URI": mlflow.get_tracking_uri(),
    }
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=5):
                return server
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                stop(server)
                raise RuntimeError(f"the server did not start; its log: {log_path}") from None
            time.sleep(0.5)


def stop(server: subprocess.Popen) -> None:
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def query(port: int, rows: list[list[float]]) -> list[dict]:
    """POST the rows to /invocations as a ``dataframe_split`` of one column, ``features``."""
    body = {"dataframe_split": {"columns": ["features"], "data": [[r] for r in rows]}}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/invocations",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())["predictions"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--store",
        default=tempfile.mkdtemp(prefix="spark-estimator-serving-"),
        help="work folder: the store, MLflow's sqlite database and artifacts, the server's "
        "log (default: a new temporary folder)",
    )
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--num-proc", type=int, default=2)
    args = parser.parse_args(argv)

    # Executors must run the same Python as this driver (and find torch in it).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = spark_session("spark-estimator mlflow serving")
    spark.sparkContext.setLogLevel("ERROR")

    # MLflow 3 tracks into a database (a new ./mlruns folder is refused): a sqlite file
    # here, its artifacts beside it; the model registry lives in the same database.
    work = os.path.abspath(args.store)
    mlflow.set_tracking_uri(f"sqlite:///{work}/mlflow.db")
    if mlflow.get_experiment_by_name("iris") is None:
        mlflow.create_experiment("iris", artifact_location=f"{work}/mlartifacts")
    mlflow.set_experiment("iris")

    x, y = load_iris(return_X_y=True)
    rows = [(features.tolist(), int(label)) for features, label in zip(x, y)]
    train, test = spark.createDataFrame(rows, ["features", "label"]).randomSplit([0.8, 0.2], 1)

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    estimator = TorchEstimator(
        model=net,
        optimizer=torch.optim.Adam(net.parameters(), lr=0.02),
        loss=torch.nn.CrossEntropyLoss(),
        feature_cols=["features"],
        label_cols=["label"],
        classification=True,  # prediction, probability and rawPrediction columns
        epochs=args.epochs,
        num_proc=args.num_proc,
        random_seed=0,
        verbose=False,
        store=Store.create(f"{work}/store"),
        mlflow_logging=True,  # params, metrics and the model, as an MLflow Model
    )
    with mlflow.start_run() as run:
        model = estimator.fit(train)
    # the fit logged its model (runs:/<run id>/model finds it too); register that one
    logged = mlflow.last_logged_model()
    version = mlflow.register_model(logged.model_uri, "iris").version
    model_uri = f"models:/iris/{version}"
    print(f"run {run.info.run_id} logged {logged.model_uri}, registered as {model_uri}")
    print("signature:", mlflow.models.get_model_info(model_uri).signature.inputs)

    held_out = test.toPandas()
    scored = model.transform(test).select("prediction", "probability").toPandas()
    port = free_port()
    server = serve(model_uri, port, f"{work}/server.log")
    try:
        predictions = query(port, [list(f) for f in held_out["features"]])
    finally:
        stop(server)
    print(f"POST /invocations with {len(held_out)} rows; the first answers:")
    for row, answer in list(zip(held_out.itertuples(), predictions))[:3]:
        probability = ", ".join(f"{p:.3f}" for p in answer["probability"])
        print(f"  {row.features} -> class {answer['prediction']:.0f} (probability [{probability}])")
    served = np.array([p["probability"] for p in predictions])
    transformed = np.stack([v.toArray() for v in scored["probability"]])
    same = (
        np.allclose(served, transformed, atol=1e-6)
        and [p["prediction"] for p in predictions] == scored["prediction"].tolist()
    )
    print(f"served == transform: {same}")
    accuracy = float(np.mean(scored["prediction"].to_numpy() == held_out["label"].to_numpy()))
    print(f"held-out accuracy: {accuracy:.3f} on {len(held_out)} rows")
    print(f"server stopped; to serve it again: MLFLOW_TRACKING_URI={mlflow.get_tracking_uri()}")
    print(f"  mlflow models serve -m {model_uri} --env-manager local -p 5000")
    spark.stop()
    return 0 if same and accuracy >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
