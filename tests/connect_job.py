"""A fit, transform, run(fn), an MLflow Model, a tuning study and the driver's errors on a
real local Spark Connect session.

Run by tests/test_connect.py in its own process: a local Connect server cannot start while
a classic SparkContext runs in the process, and once started it switches every later
session of the process to Connect. Prints one line ``RESULT <json>`` of what it observed;
the test judges it. Usage: ``python tests/connect_job.py <scratch dir>``.
"""

from __future__ import annotations

import json
import os
import sys
from importlib.util import find_spec
from pathlib import Path

os.environ["PYSPARK_PYTHON"] = sys.executable
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

from spark_estimator import Store, TorchModel, run  # noqa: E402
from spark_estimator.driver.cache_key import source_fingerprint  # noqa: E402
from spark_estimator.driver.launch import available_slots, is_connect  # noqa: E402
from tests.conftest import make_estimator, regression_rows  # noqa: E402

SCHEMA = "x array<double>, y double, id long"


def rank_sum(offset):
    from spark_estimator import distributed as sd

    return sd.allreduce(float(sd.rank()) + offset, average=False)


def error_of(call) -> str | None:
    try:
        call()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def files_and_mtimes(folder: str) -> dict[str, int]:
    """``folder`` (a local store's) and everything under it, with modification times: a
    folder's changes when an entry is made or removed in it, so a write that was cleaned
    up again still shows."""
    paths = [Path(folder), *Path(folder).rglob("*")]
    return {str(p): p.stat().st_mtime_ns for p in paths}


def fingerprints(spark, scratch: Path) -> dict:
    """Which DataFrames share a dataset key (equal fingerprints) and which do not."""
    rows = regression_rows(40)
    df = spark.createDataFrame(rows, SCHEMA)
    other = spark.newSession()
    spark.range(5).write.parquet(str(scratch / "pq"))
    read = spark.read.parquet(str(scratch / "pq"))
    read_key = source_fingerprint(read)
    read_other_session = source_fingerprint(other.read.parquet(str(scratch / "pq")))
    spark.range(6).write.mode("overwrite").parquet(str(scratch / "pq"))  # rewritten files
    df.createOrReplaceTempView("regression")
    view = spark.table("regression")
    return {
        "same_plan_again": source_fingerprint(df)
        == source_fingerprint(spark.createDataFrame(rows, SCHEMA)),
        "same_plan_other_session": source_fingerprint(df)
        == source_fingerprint(other.createDataFrame(rows, SCHEMA)),
        "filtered_differs": source_fingerprint(df) != source_fingerprint(df.filter("id > 0")),
        "other_rows_differ": source_fingerprint(df)
        != source_fingerprint(spark.createDataFrame(regression_rows(40, seed=1), SCHEMA)),
        "files_listed": len(read_key["files"]),
        "files_other_session": read_key == read_other_session,
        "rewritten_files_differ": read_key
        != source_fingerprint(spark.read.parquet(str(scratch / "pq"))),
        "view_is_session_scoped": source_fingerprint(view).get("session") == spark.session_id,
    }


def mlflow_model(model, df, scratch: Path) -> dict:
    """The fitted model logged as an MLflow Model, a Connect DataFrame its input example;
    its python_function's predictions against transform's."""
    import mlflow

    import spark_estimator.mlflow as se_mlflow

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # no registry needed: a file store
    mlflow.set_tracking_uri(f"file:{scratch / 'mlruns'}")
    with mlflow.start_run():
        info = se_mlflow.log_model(model, input_example=df)
    folder = Path(mlflow.artifacts.download_artifacts(info.model_uri))
    example = json.loads((folder / "input_example.json").read_text())
    predicted = mlflow.pyfunc.load_model(info.model_uri).predict(df.select("x").toPandas())
    scored = model.transform(df).select("prediction").toPandas()
    return {
        "example": example["columns"],
        "example_rows": len(example["data"]),
        "max_difference": float((predicted["prediction"] - scored["prediction"]).abs().max()),
        "stage_loads": TorchModel.load(str(folder)).getFeatureCols() == ["x"],
    }


def tuning(store: Store, df) -> dict:
    """An Optuna study of 3 one-process fits, 2 at once on the server's 2 slots."""
    from spark_estimator.tuning import OptunaSearch

    est = make_estimator(store=store, epochs=2, num_proc=1, validation=0.25)
    search = OptunaSearch(
        estimator=est,
        space=lambda t: {"learning_rate": t.suggest_float("lr", 1e-3, 0.3, log=True)},
        n_trials=3,
        parallelism=2,
        seed=0,
    )
    model = search.fit(df)
    spans = [(t.datetime_start, t.datetime_complete) for t in model.trials]
    return {
        "states": [t.state.name for t in model.trials],
        "at_once": max(sum(s <= start < e for s, e in spans) for start, _ in spans),
        "transformed": model.transform(df).count(),
    }


def delta_folder_error(spark, store: Store, scratch: Path) -> str | None:
    """The error of a fit on a Delta table's folder read as plain Parquet (written by
    delta-rs, where it is installed)."""
    if find_spec("deltalake") is None:
        return None
    import deltalake
    import pyarrow as pa

    root = str(scratch / "delta")
    deltalake.write_deltalake(root, pa.table({"x": [[1.0, 2.0, 3.0]] * 8, "y": [1.0] * 8}))
    df = spark.read.parquet(root)
    return error_of(lambda: make_estimator(store=store, num_proc=1, epochs=1).fit(df))


def main(scratch: Path) -> dict:
    spark = SparkSession.builder.remote("local[2]").getOrCreate()
    out: dict = {"is_connect": is_connect(spark), "slots": available_slots(spark)}
    store = Store.create(str(scratch / "store"))
    df = spark.createDataFrame(regression_rows(), SCHEMA)

    # errors raised on the driver before any Spark job: nothing reaches the store
    out["too_many_procs"] = error_of(lambda: make_estimator(store=store, num_proc=3).fit(df))
    out["delta_folder"] = delta_folder_error(spark, store, scratch)
    out["datasets_after_error"] = store.exists(store.datasets)

    model = make_estimator(store=store, epochs=15).fit(df)
    module = model.getModel()
    out["weight"] = module.weight.detach().flatten().tolist()
    out["bias"] = module.bias.item()
    out["final_loss"] = model.getHistory()[-1]["train"]["loss"]
    rows = model.transform(df).select("y", "prediction").collect()
    out["rows"] = len(rows)
    out["max_error"] = max(abs(r.y - r.prediction) for r in rows)
    out["mlflow"] = mlflow_model(model, df, scratch) if find_spec("mlflow") else None

    est = make_estimator(store=store, epochs=1)
    path = est.materialize(df)
    before = files_and_mtimes(store.datasets)
    out["reused"] = est.materialize(df) == path
    out["reuse_wrote_nothing"] = files_and_mtimes(store.datasets) == before
    out["other_plan_other_dataset"] = est.materialize(df.filter("id > 0")) != path
    refit = make_estimator(store=store, epochs=1).fit_on_parquet(path)
    out["fit_on_parquet_epochs"] = len(refit.getHistory())

    model.save(str(scratch / "model"))
    loaded = TorchModel.load(str(scratch / "model"))
    out["loaded_equal"] = all(
        torch.equal(a, b)
        for a, b in zip(module.state_dict().values(), loaded.getModel().state_dict().values())
    )
    out["run"] = run(rank_sum, args=(0.5,), num_proc=2, use_gpu=False)
    out["tuning"] = tuning(store, df)
    out["fingerprints"] = fingerprints(spark, scratch)
    return out


if __name__ == "__main__":
    result = main(Path(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # do not wait for the local server's threads
