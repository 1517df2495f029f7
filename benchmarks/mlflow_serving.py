"""The logged MLflow model against ``TorchModel.transform``: Spark rows/s and REST latency.

A hand-run benchmark, not a test. The model is the job's MLP 32-256-256-1 (untrained
weights from a fixed seed: inference costs the same) as a TorchModel that records the fit's
columns as a fit does (``features``: an array of 32 values), saved as an MLflow Model with
``spark_estimator.mlflow.save_model`` (its signature: a float32 tensor ``features`` of shape
(-1, 32) in, a double out). The rows are the job's 1M x 32 float32 features (see
bench_common.py), read from Parquet on ``local[2]`` and cached (counted once before any
timing), so that each pass times the scoring, not the Parquet read. Every configuration
runs one untimed pass (which also starts the Python workers and loads the model in them),
then ``--repeats`` rounds each time every configuration once, in turn, each to Spark's
``noop`` sink (every row computed, nothing written):

(a) ``TorchModel.transform(df)``;
(b) ``df.withColumn("prediction", udf("features"))``, ``udf`` being
    ``mlflow.pyfunc.spark_udf(spark, <saved model>, env_manager="local")``: MLflow's pandas
    UDF, its check of each batch against the signature, then our ``predict`` (the same
    batched inference as transform). For what MLflow's check costs, the same model saved
    with other signatures: its column signature (``features`` an array of doubles, as a
    model whose widths are not known gets; MLflow checks such a column row by row), and
    its outputs only (``ModelSignature(outputs=...)``: no input check; the UDF then takes
    the column by name in a struct);
(c) the REST endpoint: ``mlflow models serve -m <saved model> --env-manager local`` (one
    worker) on 127.0.0.1, started by this script; ``--requests`` POSTs to ``/invocations`` of
    1 row and of 256 rows each (``dataframe_split`` JSON, the job's first rows), after
    ``--warmup`` untimed ones, one at a time; each request's latency (the client's wall
    time, JSON encoding and decoding included) as median, p90 and p99, and the 256-row
    requests' rows/s.

Target: (b) >= 0.8 x (a) in rows/s: the median over the rounds of each round's ratio
(min and max shown); (c) is reported. Results are printed and written to
``benchmarks/results/mlflow_serving.md`` (a run smaller than the full job writes to a
temporary folder instead; ``--no-record`` writes nothing). Needs full MLflow
(``pip install -e '.[serving]'``).

Run from the repository root::

    .venv/bin/python benchmarks/mlflow_serving.py
    .venv/bin/python benchmarks/mlflow_serving.py --rows 200000 --requests 20  # quick
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
Spark's noop sink) against `TorchModel.transform` on the same cached DataFrame (MLP
32-256-256-1, 1M rows x 32 float32 features from Parquet), passes interleaved; and the
latency of `mlflow models serve`'s `/invocations` for requests of 1 and 256 rows. Target:
spark_udf >= 0.8 x transform.

    .venv/bin/python benchmarks/mlflow_serving.py [--rows N] [--repeats R] [--requests N]

Each run replaces the section of its stack below and keeps the others.
"""


def rates(runs: dict[str, Callable[[], None]], rows: int, repeats: int, quiet_s: float) -> dict:
    """name -> rows/s of each of ``repeats`` timed calls of ``runs[name]``, after one
    untimed call of each; the timed calls in rounds of every run in turn, so that the
    machine's drift falls on all of them alike. ``"contended"``: the calls started while
    other processes kept the CPUs busy."""
    for run in runs.values():
        run()
    found: dict = {name: [] for name in runs}
    found["contended"] = 0
    for _ in range(repeats):
        for name, run in runs.items():
            found["contended"] += not bc.wait_quiet(quiet_s)
            start = time.perf_counter()
            run()
            found[name].append(rows / (time.perf_counter() - start))
    return found


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
    from mlflow.types.schema import Array, ColSpec, Schema
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
        feature_lengths={"features": bc.FEATURES},
    )
    work = Path(tempfile.mkdtemp(prefix="spark-estimator-bench-mlflow-"))
    saved = str(work / "model")
    se_mlflow.save_model(model, saved)
    signature = mlflow.models.get_model_info(saved).signature
    columns = str(work / "column-signature")
    inputs = Schema([ColSpec(Array("double"), "features")])
    se_mlflow.save_model(model, columns, signature=ModelSignature(inputs, signature.outputs))
    outputs_only = str(work / "outputs-only")
    se_mlflow.save_model(model, outputs_only, signature=ModelSignature(outputs=signature.outputs))

    def noop(df) -> Callable[[], None]:
        return lambda: df.write.format("noop").mode("overwrite").save()

    def udf(path: str):
        return mlflow.pyfunc.spark_udf(spark, path, env_manager="local")

    source = bc.frame(spark, path).cache()
    source.count()
    partitions = source.rdd.getNumPartitions()
    runs = {
        "transform": noop(model.transform(source)),
        "spark_udf": noop(source.withColumn("prediction", udf(saved)("features"))),
        "spark_udf, column signature": noop(
            source.withColumn("prediction", udf(columns)("features"))
        ),
        # without input names in the signature, a struct passes the columns by name
        "spark_udf, no input check": noop(
            source.withColumn("prediction", udf(outputs_only)(F.struct("features")))
        ),
    }
    print(f"signature: {signature.inputs} -> {signature.outputs}", flush=True)
    results = rates(runs, args.rows, args.repeats, args.quiet_timeout)
    contended = results.pop("contended")
    ratios = {  # each round's ratio to transform's pass of the same round
        name: [a / b for a, b in zip(passes, results["transform"])]
        for name, passes in results.items()
    }
    for name, passes in results.items():
        r = ratios[name]
        print(
            f"{name:<30} median {statistics.median(passes):,.0f} rows/s; / transform: "
            f"median {statistics.median(r):.2f} (min {min(r):.2f}, max {max(r):.2f})",
            flush=True,
        )
    source.unpersist()

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

    ratio = statistics.median(ratios["spark_udf"])
    full = args.rows >= bc.FULL_ROWS
    lines = [
        f"## {env['date']}, stack `{env['venv']}`",
        "",
        *bc.machine_lines(env, ("mlflow",)),
        f"- Rows: {args.rows:,} ({'the full job' if full else 'SMALLER THAN THE FULL JOB'}); "
        f"`{args.master}`, {partitions} Spark partitions of the cached DataFrame; "
        f"{args.repeats} rounds of timed passes (each configuration in turn) after an "
        f"untimed pass each, {contended} pass(es) started while other processes kept the "
        "CPUs busy",
        f"- The model's signature: `{signature.inputs}` in, `{signature.outputs}` out",
        "",
        "| configuration | median rows/s | best rows/s | / transform: median (min, max) |",
        "|---|---:|---:|---:|",
    ]
    for name, passes in results.items():
        r = ratios[name]
        lines.append(
            f"| {name} | {statistics.median(passes):,.0f} | {max(passes):,.0f} "
            f"| {statistics.median(r):.2f} ({min(r):.2f}, {max(r):.2f}) |"
        )
    lines += [
        "",
        f"- spark_udf / transform, the median of the rounds' ratios: **{ratio:.2f}** "
        f"(target >= {TARGET_UDF}: {'met' if ratio >= TARGET_UDF else 'MISSED'})",
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
