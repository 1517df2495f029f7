"""The logged MLflow model against ``TorchModel.transform``: Spark rows/s and REST latency.

A hand-run benchmark, not a test. The model is the job's MLP 32-256-256-1 (untrained
weights from a fixed seed: inference costs the same) as a TorchModel that records the fit's
columns (``features``: an array), saved as an MLflow Model with
``spark_estimator.mlflow.save_model`` (its signature: an array of doubles in, a double
out). The rows are the job's 1M x 32 float32 features (see bench_common.py), read from
Parquet on ``local[2]``. Side by side in one run, best and median of ``--repeats`` timed
passes after one untimed pass each (which also starts the Python workers and loads the
model in them):

(a) ``TorchModel.transform(df)`` written to Spark's ``noop`` sink;
(b) ``df.withColumn("prediction", udf("features"))`` to the same sink, ``udf`` being
    ``mlflow.pyfunc.spark_udf(spark, <saved model>, env_manager="local")``: MLflow's pandas
    UDF, its schema check of each batch, then our ``predict`` (pandas to Arrow, the same
    batched inference as transform); and, for what MLflow's check of the input columns
    costs (it checks an array column row by row), the same model saved with a signature of
    its outputs only (``ModelSignature(outputs=...)``: no input check);
(c) the REST endpoint: ``mlflow models serve -m <saved model> --env-manager local`` (one
    worker) on 127.0.0.1, started by this script; ``--requests`` POSTs to ``/invocations`` of
    1 row and of 256 rows each (``dataframe_split`` JSON, the job's first rows), after
    ``--warmup`` untimed ones, one at a time; each request's latency (the client's wall
    time, JSON encoding and decoding included) as median, p90 and p99, and the 256-row
    requests' rows/s.

Target: (b) >= 0.8 x (a) in rows/s; (c) is reported. Results are printed and written to
``benchmarks/results/mlflow_serving.md`` (a run smaller than the full job writes to a
temporary folder instead; ``--no-record`` writes nothing). Needs full MLflow
(``pip install -e '.[serving]'``).

Run from the repository root::

    .venv/bin/python benchmarks/mlflow_serving.py
    .venv/bin/python benchmarks/mlflow_serving.py --rows 20000 --requests 20  # quick
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402

TARGET_UDF = 0.8
REQUEST_ROWS = (1, 256)
HEADER = """\
# MLflow serving (benchmarks/mlflow_serving.py)

Rows/s of the logged MLflow model in a Spark job (`mlflow.pyfunc.spark_udf`, `local[2]`, to
Spark's noop sink) against `TorchModel.transform` on the same DataFrame (MLP 32-256-256-1,
1M rows x 32 float32 features from Parquet), and the latency of `mlflow models serve`'s
`/invocations` for requests of 1 and 256 rows. Target: spark_udf >= 0.8 x transform.

    .venv/bin/python benchmarks/mlflow_serving.py [--rows N] [--repeats R] [--requests N]

Each run replaces the section of its stack below and keeps the others.
"""


def rate(run: Callable[[], None], rows: int, repeats: int, quiet_s: float) -> dict:
    """Rows/s of ``run`` over ``repeats`` timed calls after one untimed call."""
    run()
    rates, contended = [], 0
    for _ in range(repeats):
        contended += not bc.wait_quiet(quiet_s)
        start = time.perf_counter()
        run()
        rates.append(rows / (time.perf_counter() - start))
    return {"best": max(rates), "median": statistics.median(rates), "contended": contended}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model_path: str, port: int, log_path: Path) -> subprocess.Popen:
    """``mlflow models serve`` of ``model_path`` in its own process group, once /ping answers."""
    command = [sys.executable, "-m", "mlflow", "models", "serve", "-m", model_path]
    command += ["--env-manager", "local", "-h", "127.0.0.1", "-p", str(port), "-w", "1"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
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


def latencies(port: int, body: bytes, count: int, warmup: int, rows: int) -> list[float]:
    """Seconds of each of ``count`` POSTs of ``body`` after ``warmup`` untimed ones, checking
    each answer has ``rows`` predictions."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/invocations",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    times = []
    for i in range(warmup + count):
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=120) as answer:
            predictions = json.loads(answer.read())["predictions"]
        if i >= warmup:
            times.append(time.perf_counter() - start)
        if len(predictions) != rows:
            raise RuntimeError(f"{rows} rows sent, {len(predictions)} predictions answered")
    return times


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=bc.FULL_ROWS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200, help="timed requests per size")
    parser.add_argument("--warmup", type=int, default=10, help="untimed requests per size")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--data", default=str(bc.DATA), help="folder of the generated Parquet")
    parser.add_argument("--quiet-timeout", type=float, default=60.0)
    bc.add_record_args(parser)
    args = parser.parse_args()

    import mlflow
    from mlflow.models import ModelSignature
    from pyspark.sql import functions as F

    import spark_estimator.mlflow as se_mlflow
    from spark_estimator import TorchModel

    path = bc.dataset(args.rows, Path(args.data))
    spark = bc.spark_session(args.master)
    env = bc.machine(("mlflow",))
    print(f"{args.rows:,} rows; {env['cpu']}, {env['cores']} cores", flush=True)
    model = TorchModel(
        model=bc.mlp().eval(),
        feature_cols=["features"],
        output_shapes=[[1]],
        feature_kinds={"features": ["array", "float32"]},
    )
    work = Path(tempfile.mkdtemp(prefix="spark-estimator-bench-mlflow-"))
    saved = str(work / "model")
    se_mlflow.save_model(model, saved)
    outputs_only = str(work / "outputs-only")
    signature = mlflow.models.get_model_info(saved).signature
    se_mlflow.save_model(model, outputs_only, signature=ModelSignature(outputs=signature.outputs))
    results: dict[str, dict] = {}

    def run_and_print(name: str, run: Callable[[], None]) -> None:
        results[name] = rate(run, args.rows, args.repeats, args.quiet_timeout)
        r = results[name]
        print(f"{name:<36} best {r['best']:,.0f} rows/s, median {r['median']:,.0f}", flush=True)

    def noop(df) -> Callable[[], None]:
        return lambda: df.write.format("noop").mode("overwrite").save()

    source = bc.frame(spark, path)
    partitions = source.rdd.getNumPartitions()
    run_and_print("transform", noop(model.transform(source)))
    udf = mlflow.pyfunc.spark_udf(spark, saved, env_manager="local")
    run_and_print("spark_udf", noop(source.withColumn("prediction", udf("features"))))
    # without input names in the signature, a struct passes the columns by name
    udf = mlflow.pyfunc.spark_udf(spark, outputs_only, env_manager="local")
    unchecked = source.withColumn("prediction", udf(F.struct("features")))
    run_and_print("spark_udf, no input check", noop(unchecked))

    first = bc.job_arrays(max(REQUEST_ROWS))[0]
    port = free_port()
    server = serve(saved, port, work / "server.log")
    served: dict[int, list[float]] = {}
    try:
        for rows in REQUEST_ROWS:
            data = [[x.tolist()] for x in first[:rows]]
            body = json.dumps({"dataframe_split": {"columns": ["features"], "data": data}})
            bc.wait_quiet(args.quiet_timeout)
            served[rows] = latencies(port, body.encode(), args.requests, args.warmup, rows)
            ms = [t * 1000 for t in served[rows]]
            print(
                f"REST, {rows} row(s) a request: median {statistics.median(ms):.1f} ms, "
                f"p90 {percentile(ms, 0.9):.1f}, p99 {percentile(ms, 0.99):.1f}",
                flush=True,
            )
    finally:
        stop(server)
    spark.stop()

    ours, theirs = results["transform"], results["spark_udf"]
    ratio = theirs["best"] / ours["best"]
    full = args.rows >= bc.FULL_ROWS
    contended = sum(r["contended"] for r in results.values())
    lines = [
        f"## {env['date']}, stack `{env['venv']}`",
        "",
        *bc.machine_lines(env, ("mlflow",)),
        f"- Rows: {args.rows:,} ({'the full job' if full else 'SMALLER THAN THE FULL JOB'}); "
        f"`{args.master}`, {partitions} Spark partitions; best and median of {args.repeats} "
        f"timed passes after an untimed one, {contended} pass(es) started while other "
        "processes kept the CPUs busy",
        "",
        "| configuration | best rows/s | median rows/s | best / transform |",
        "|---|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['best']:,.0f} | {r['median']:,.0f} | {r['best'] / ours['best']:.2f} |"
        )
    lines += [
        "",
        f"- spark_udf / transform: **{ratio:.2f}** (target >= {TARGET_UDF}: "
        f"{'met' if ratio >= TARGET_UDF else 'MISSED'})",
        "",
        f"`mlflow models serve` (1 worker), {args.requests} timed requests of each size after "
        f"{args.warmup} untimed, one at a time:",
        "",
        "| rows a request | median ms | p90 ms | p99 ms | rows/s (median) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for rows, times in served.items():
        ms = [t * 1000 for t in times]
        median = statistics.median(ms)
        lines.append(
            f"| {rows} | {median:.1f} | {percentile(ms, 0.9):.1f} | {percentile(ms, 0.99):.1f} "
            f"| {rows / median * 1000:,.0f} |"
        )
    section = "\n".join(lines) + "\n"
    print("\n" + section)
    bc.record(args, "mlflow_serving", HEADER, section, env["venv"], full)


if __name__ == "__main__":
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    main()
