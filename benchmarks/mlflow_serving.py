"""The logged MLflow model against ``TorchModel.transform``: Spark rows/s and REST latency.

A hand-run benchmark, not a test. Three models (``models``), each a TorchModel that records
the fit's columns as a fit does (``features``: an array of 32 values), with untrained
weights from fixed seeds (inference costs the same), saved as MLflow Models with
``spark_estimator.mlflow.save_model`` (their signature: a float32 tensor ``features`` of
shape (-1, 32) in): the job's MLP 32-256-256-1 as a regressor (a double out); the MLP with
``CLASSES`` logits as a classifier (``rawPrediction``, ``probability`` arrays and
``prediction``); and the MLP's hidden layers with two heads (a double and an array of
``EMBEDDING`` floats). The rows are the job's 1M x 32 float32 features (see
bench_common.py), read from Parquet on ``local[2]`` and cached (counted once before any
timing), so that each pass times the scoring, not the Parquet read. For each model, every
configuration runs one untimed pass (which also starts the Python workers and loads the
model in them), then ``--repeats`` rounds each time every configuration of that model once,
in turn, each to Spark's ``noop`` sink (every row computed, nothing written):

(a) ``TorchModel.transform(df)``;
(b) ``df.withColumn(name, udf("features"))``, ``udf`` being
    ``mlflow.pyfunc.spark_udf(spark, <saved model>, env_manager="local")``: MLflow's pandas
    UDF, its check of each batch against the signature, then our ``predict`` (the same
    batched inference as transform), then MLflow's conversion of its result (a struct of
    the columns for the classifier and the two-headed model, converted an array value at a
    time). For the regressor, what MLflow's input check costs: the same model saved with
    other signatures, its column signature (``features`` an array of doubles, as a model
    whose widths are not known gets; MLflow checks such a column row by row), and its
    outputs only (``ModelSignature(outputs=...)``: no input check; the UDF then takes the
    column by name in a struct). For the others, the bulk form:
    ``result_type="array<double>"`` with ``params={"output_array": [...]}`` (``predict``
    returns the named columns as one array a row, which MLflow converts a batch at once),
    and for the classifier ``result_type="double"`` (its ``prediction`` alone);
(c) the REST endpoint, for the regressor: ``mlflow models serve -m <saved model>
    --env-manager local`` (one worker) on 127.0.0.1, started by this script; ``--requests``
    POSTs to ``/invocations`` of 1 row and of 256 rows each (``dataframe_split`` JSON, the
    job's first rows), after ``--warmup`` untimed ones, one at a time; each request's
    latency (the client's wall time, JSON encoding and decoding included) as median, p90
    and p99, and the 256-row requests' rows/s.

Target: (b) >= 0.8 x (a) in rows/s for each model, judged by its ``BEST`` configuration
(the default ``spark_udf`` for the regressor, ``output_array`` for the others): the median
over the rounds of each round's ratio (min and max shown); the rest and (c) are reported.
Results are printed and written to ``benchmarks/results/mlflow_serving.md`` (a run smaller
than the full job writes to a temporary folder instead; ``--no-record`` writes nothing).
Needs full MLflow (``pip install -e '.[serving]'``).

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
import torch  # noqa: E402

TARGET_UDF = 0.8
BEST = {  # the configuration each model's target is judged by
    "regressor": "spark_udf",
    "classifier": 'spark_udf, output_array ["probability"]',
    "multi-output": "spark_udf, output_array of both columns",
}
REQUEST_ROWS = (1, 256)
HEADER = """\
# MLflow serving (benchmarks/mlflow_serving.py)

Rows/s of the logged MLflow model in a Spark job (`mlflow.pyfunc.spark_udf`, `local[2]`, to
Spark's noop sink) against `TorchModel.transform` on the same cached DataFrame (1M rows x 32
float32 features from Parquet), passes interleaved, for three models: an MLP 32-256-256-1
regressor, the MLP as a 3-class classifier, and the MLP's hidden layers with two heads (a
double and 8 floats); and the latency of `mlflow models serve`'s `/invocations` for requests
of 1 and 256 rows (the regressor). Target: spark_udf >= 0.8 x transform for each model (the
classifier and the two-headed model with `output_array`, the form MLflow converts a batch at
once; docs/serving.md, Throughput in Spark).

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


CLASSES = 3  # the classifier's classes
EMBEDDING = 8  # the multi-output model's second output's width


def models() -> dict:
    """The benchmark's models, each a TorchModel recording the fit's columns as a fit does:
    the job's MLP (a regressor), the MLP with ``CLASSES`` logits as a classifier, and the
    MLP's hidden layers with two heads (a score [1], an embedding [``EMBEDDING``])."""
    from spark_estimator import TorchModel

    columns = {
        "feature_cols": ["features"],
        "feature_kinds": {"features": ["array", "float32"]},
        "feature_lengths": {"features": 32},
    }
    classifier = bc.mlp()
    torch.manual_seed(1)
    classifier[-1] = torch.nn.Linear(classifier[-1].in_features, CLASSES)
    return {
        "regressor": TorchModel(model=bc.mlp().eval(), output_shapes=[[1]], **columns),
        "classifier": TorchModel(model=classifier.eval(), classification=True, **columns),
        "multi-output": TorchModel(
            model=TwoHeads(bc.mlp()).eval(), output_shapes=[[1], [EMBEDDING]], **columns
        ),
    }


class TwoHeads(torch.nn.Module):
    """The MLP's hidden layers, then its last layer as a score [1] and a tanh embedding
    [EMBEDDING]."""

    def __init__(self, mlp: torch.nn.Sequential):
        super().__init__()
        self.trunk, self.score = mlp[:-1], mlp[-1]
        torch.manual_seed(2)
        self.embed = torch.nn.Linear(mlp[-1].in_features, EMBEDDING)

    def forward(self, x):
        hidden = self.trunk(x)
        return self.score(hidden), torch.tanh(self.embed(hidden))


def summarize(name: str, results: dict) -> dict:
    """Print each configuration's median rows/s and its ratios to transform's pass of the
    same round; the ratios by configuration."""
    ratios = {
        config: [a / b for a, b in zip(passes, results["transform"])]
        for config, passes in results.items()
    }
    for config, passes in results.items():
        r = ratios[config]
        print(
            f"{name}: {config:<42} median {statistics.median(passes):,.0f} rows/s; / transform: "
            f"median {statistics.median(r):.2f} (min {min(r):.2f}, max {max(r):.2f})",
            flush=True,
        )
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=bc.FULL_ROWS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200, help="timed requests per size")
    parser.add_argument("--warmup", type=int, default=10, help="untimed requests per size")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--data", default=str(bc.DATA), help="folder of the generated Parquet")
    parser.add_argument("--quiet-timeout", type=float, default=60.0)
    parser.add_argument(
        "--models",
        nargs="+",
        choices=list(BEST),
        default=list(BEST),
        help="the models to time (REST: with the regressor only)",
    )
    bc.add_record_args(parser)
    args = parser.parse_args()

    import mlflow
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Array, ColSpec, Schema
    from pyspark.sql import functions as F

    import spark_estimator.mlflow as se_mlflow

    path = bc.dataset(args.rows, Path(args.data))
    spark = bc.spark_session(args.master)
    env = bc.machine(("mlflow",))
    print(f"{args.rows:,} rows; {env['cpu']}, {env['cores']} cores", flush=True)
    work = Path(tempfile.mkdtemp(prefix="spark-estimator-bench-mlflow-"))
    saved, signatures = {}, {}
    for name, model in models().items():
        saved[name] = str(work / name)
        se_mlflow.save_model(model, saved[name])
        signatures[name] = mlflow.models.get_model_info(saved[name]).signature
    model = models()
    signature = signatures["regressor"]
    columns = str(work / "column-signature")
    inputs = Schema([ColSpec(Array("double"), "features")])
    se_mlflow.save_model(
        model["regressor"], columns, signature=ModelSignature(inputs, signature.outputs)
    )
    outputs_only = str(work / "outputs-only")
    se_mlflow.save_model(
        model["regressor"], outputs_only, signature=ModelSignature(outputs=signature.outputs)
    )

    def noop(df) -> Callable[[], None]:
        return lambda: df.write.format("noop").mode("overwrite").save()

    def udf(path: str, **options):
        return mlflow.pyfunc.spark_udf(spark, path, env_manager="local", **options)

    def array_udf(path: str, names: list[str]):
        return udf(path, result_type="array<double>", params={"output_array": names})

    source = bc.frame(spark, path).cache()
    source.count()
    partitions = source.rdd.getNumPartitions()
    scored = source.withColumn  # each configuration appends its column to every row
    runs = {
        "regressor": {
            "transform": noop(model["regressor"].transform(source)),
            "spark_udf": noop(scored("prediction", udf(saved["regressor"])("features"))),
            "spark_udf, column signature": noop(scored("prediction", udf(columns)("features"))),
            # without input names in the signature, a struct passes the columns by name
            "spark_udf, no input check": noop(
                scored("prediction", udf(outputs_only)(F.struct("features")))
            ),
        },
        "classifier": {
            "transform": noop(model["classifier"].transform(source)),
            "spark_udf (a struct of the 3 columns)": noop(
                scored("scores", udf(saved["classifier"])("features"))
            ),
            'spark_udf, output_array ["probability"]': noop(
                scored("p", array_udf(saved["classifier"], ["probability"])("features"))
            ),
            "spark_udf, output_array of all 3 columns": noop(
                scored(
                    "p",
                    array_udf(saved["classifier"], ["rawPrediction", "probability", "prediction"])(
                        "features"
                    ),
                )
            ),
            'spark_udf, result_type="double" (prediction)': noop(
                scored("p", udf(saved["classifier"], result_type="double")("features"))
            ),
        },
        "multi-output": {
            "transform": noop(model["multi-output"].transform(source)),
            "spark_udf (a struct of the 2 columns)": noop(
                scored("scores", udf(saved["multi-output"])("features"))
            ),
            "spark_udf, output_array of both columns": noop(
                scored(
                    "p",
                    array_udf(saved["multi-output"], ["prediction_0", "prediction_1"])("features"),
                )
            ),
        },
    }
    for name, sig in signatures.items():
        print(f"{name}'s signature: {sig.inputs} -> {sig.outputs}", flush=True)
    results, ratios, contended = {}, {}, 0
    runs = {name: configs for name, configs in runs.items() if name in args.models}
    for name, configs in runs.items():
        results[name] = rates(configs, args.rows, args.repeats, args.quiet_timeout)
        contended += results[name].pop("contended")
        ratios[name] = summarize(name, results[name])
    source.unpersist()

    first = bc.job_arrays(max(REQUEST_ROWS))[0]
    port = free_port()
    served: dict[int, list[float]] = {}
    server = serve(saved["regressor"], port, work / "server.log")
    try:
        for rows in REQUEST_ROWS if "regressor" in args.models else ():
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

    full = args.rows >= bc.FULL_ROWS
    lines = [
        f"## {env['date']}, stack `{env['venv']}`",
        "",
        *bc.machine_lines(env, ("mlflow",)),
        f"- Rows: {args.rows:,} ({'the full job' if full else 'SMALLER THAN THE FULL JOB'}); "
        f"`{args.master}`, {partitions} Spark partitions of the cached DataFrame; "
        f"{args.repeats} rounds of timed passes (each configuration of a model in turn) "
        f"after an untimed pass each, {contended} pass(es) started while other processes "
        "kept the CPUs busy",
    ]
    for name, sig in signatures.items():
        lines.append(f"- The {name}'s signature: `{sig.inputs}` in, `{sig.outputs}` out")
    lines += [
        "",
        "| model | configuration | median rows/s | best rows/s | / transform: median (min, max) |",
        "|---|---|---:|---:|---:|",
    ]
    for name, found in results.items():
        for config, passes in found.items():
            r = ratios[name][config]
            lines.append(
                f"| {name} | {config} | {statistics.median(passes):,.0f} | {max(passes):,.0f} "
                f"| {statistics.median(r):.2f} ({min(r):.2f}, {max(r):.2f}) |"
            )
    lines.append("")
    for name, config in BEST.items():
        if name not in ratios:
            continue
        ratio = statistics.median(ratios[name][config])
        lines.append(
            f"- {name}, {config} / transform, the median of the rounds' ratios: "
            f"**{ratio:.2f}** (target >= {TARGET_UDF}: "
            f"{'met' if ratio >= TARGET_UDF else 'MISSED'})"
        )
    lines += [
        "",
        f"`mlflow models serve` of the regressor (1 worker), {args.requests} timed requests of "
        f"each size after {args.warmup} untimed, one at a time:",
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
