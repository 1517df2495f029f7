"""spark_estimator.mlflow against a real MLflow tracking store and model registry (sqlite),
real Spark jobs and a real ``mlflow models serve`` process: a tabular regressor, a
classifier, a multi-output model reading strings through its decode_fn, and an image
classifier fitted on binaryFile bytes (logged by mlflow_logging) predict what transform
appends, through pyfunc, spark_udf and REST."""

from __future__ import annotations

import base64
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from pyspark.ml.linalg import Vectors
from pyspark.sql import functions as F

import spark_estimator.mlflow as se_mlflow
from spark_estimator import Store, TorchEstimator, TorchModel
from tests.conftest import LOCAL, linear_net, spark_session

mlflow = pytest.importorskip("mlflow")
from mlflow.exceptions import MlflowException  # noqa: E402

from spark_estimator.pyfunc import TorchPyfunc  # noqa: E402

Image = pytest.importorskip("PIL.Image", reason="needs Pillow (the vision extra)")
pytest.importorskip("flask", reason="needs full mlflow (the serving extra), not mlflow-skinny")

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["ab", "ba", "abc", "cab", "bcc", "a", "cc", "bca"]


def letter_counts(row, augment):
    """decode_fn of the string column ``text``: its counts of a, b and c."""
    return {"text": torch.tensor([float(row["text"].count(c)) for c in "abc"])}


class TwoHeads(torch.nn.Module):
    """letter counts [B, 3] (and their mask, as a decoded 1-D tensor gets) -> a score
    [B, 1] and an embedding [B, 2]."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.score, self.embed = torch.nn.Linear(3, 1), torch.nn.Linear(3, 2)

    def forward(self, counts, mask):
        return self.score(counts), torch.tanh(self.embed(counts))


class TinyCNN(torch.nn.Module):
    """uint8 RGB images [B, 3, 8, 8] -> 2 class logits."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.conv, self.out = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Linear(4, 2)

    def forward(self, images):
        x = torch.relu(self.conv(images.float() / 255))
        return self.out(x.mean((2, 3)))


def write_images(folder: Path) -> None:
    """8x8 RGB pictures of two classes (dark, light) in ``folder/<class>/``, PNG and JPEG."""
    rng = np.random.default_rng(0)
    for i in range(12):
        label = i % 2
        pixels = rng.integers(0, 100, (8, 8, 3)) + 150 * label
        (folder / str(label)).mkdir(parents=True, exist_ok=True)
        suffix = "png" if i % 3 else "jpg"
        Image.fromarray(pixels.astype(np.uint8)).save(folder / str(label) / f"{i:02d}.{suffix}")


@pytest.fixture(scope="module")
def tracking(tmp_path_factory):
    """A sqlite tracking store and registry, its artifacts in a folder of this module (the
    experiment chosen by MLflow's environment variable, which leaves with the module)."""
    folder = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    with pytest.MonkeyPatch.context() as patch:
        experiment = mlflow.create_experiment("serving", str(folder / "artifacts"))
        patch.setenv("MLFLOW_EXPERIMENT_ID", experiment)
        yield uri
    mlflow.set_tracking_uri(None)


@pytest.fixture(scope="module")
def models(tracking, tmp_path_factory) -> dict:
    """name -> (registered URI, TorchModel, Spark DataFrame of its feature columns, what
    transform appends to it)."""
    spark = spark_session(LOCAL)
    found = {}

    tabular = spark.createDataFrame(
        [([float(i), 1.0 - i, 0.5 * i], i) for i in range(6)], "x array<double>, id long"
    )
    regressor = TorchModel(
        model=linear_net(),
        feature_cols=["x"],
        output_shapes=[[1]],
        feature_kinds={"x": ["array", "float32"]},
    )
    with mlflow.start_run() as run:
        se_mlflow.log_model(regressor, input_example=tabular)
    mlflow.register_model(f"runs:/{run.info.run_id}/model", "regressor")
    found["regressor"] = ("models:/regressor/1", regressor, tabular)

    vectors = spark.createDataFrame(
        [(Vectors.dense([i, -i, 1.0, 0.5]),) for i in range(6)], ["features"]
    )
    classifier = TorchModel(
        model=linear_net(4, 3),
        feature_cols=["features"],
        classification=True,
        output_shapes=[[3]],
        feature_kinds={"features": ["vector", "float32"]},
    )
    se_mlflow.log_model(classifier, input_example=vectors, registered_model_name="classifier")
    found["classifier"] = ("models:/classifier/1", classifier, vectors)

    texts = spark.createDataFrame([(w,) for w in WORDS], "text string")
    two_heads = TorchModel(
        model=TwoHeads(),
        feature_cols=["text"],
        output_cols=["score", "embedding"],
        output_shapes=[[1], [2]],
        decode_fn=letter_counts,
        feature_kinds={"text": ["string", "float32"]},
    )
    example = pd.DataFrame({"text": WORDS[:2]})
    se_mlflow.log_model(two_heads, input_example=example, registered_model_name="two_heads")
    found["two_heads"] = ("models:/two_heads/1", two_heads, texts)

    folder = tmp_path_factory.mktemp("images")
    write_images(folder)
    images = spark.read.format("binaryFile").load(f"{folder}/*/*")
    labelled = images.withColumn("label", F.regexp_extract("path", r"/(\d)/[^/]+$", 1).cast("long"))
    net = TinyCNN()
    with mlflow.start_run() as run:
        fitted = TorchEstimator(
            model=net,
            optimizer=torch.optim.Adam(net.parameters(), lr=0.01),
            loss=torch.nn.CrossEntropyLoss(),
            feature_cols=["content"],
            label_cols=["label"],
            classification=True,
            batch_size=4,
            epochs=1,
            num_proc=1,
            use_gpu=False,
            verbose=False,
            store=Store.create(str(tmp_path_factory.mktemp("store"))),
            mlflow_logging=True,
        ).fit(labelled)
    version = mlflow.register_model(f"runs:/{run.info.run_id}/model", "images").version
    found["images"] = (f"models:/images/{version}", fitted, images.select("content", "path"))
    found = {kind: (*entry, transformed(entry[1], entry[2])) for kind, entry in found.items()}
    found["images_run"] = run.info.run_id
    return found


KINDS = ["regressor", "classifier", "two_heads", "images"]


def transformed(model: TorchModel, df) -> pd.DataFrame:
    """What transform appends, ML vectors as arrays."""
    scored = model.transform(df)
    added = [c for c in scored.columns if c not in df.columns]
    return scored.select(*added).toPandas()


def assert_same(got: pd.DataFrame, want: pd.DataFrame) -> None:
    assert list(got.columns) == list(want.columns)
    assert len(got) == len(want)
    for name in want.columns:
        expect = np.stack([np.asarray(getattr(v, "toArray", lambda v=v: v)()) for v in want[name]])
        found = np.stack([np.asarray(v, dtype=np.float64) for v in got[name]])
        np.testing.assert_allclose(found, expect, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_the_registered_model_predicts_what_transform_appends(models, kind):
    uri, model, df, want = models[kind]
    loaded = mlflow.pyfunc.load_model(uri)
    pdf = df.toPandas()
    if kind == "classifier":
        pdf["features"] = [v.toArray().tolist() for v in pdf["features"]]  # JSON's form
    assert_same(loaded.predict(pdf), want)
    assert isinstance(loaded.get_raw_model(), TorchModel)


@pytest.mark.parametrize("kind", KINDS)
def test_spark_udf_of_the_model_gives_the_same_in_a_spark_job(models, kind):
    uri, model, df, want = models[kind]
    if kind == "classifier":
        from pyspark.ml.functions import vector_to_array

        df = df.select(vector_to_array("features").alias("features"))
    udf = mlflow.pyfunc.spark_udf(df.sparkSession, uri, env_manager="local")
    features = model.getFeatureCols()
    scored = df.coalesce(1).withColumn("out", udf(*[F.col(c) for c in features]))
    if len(want.columns) == 1:  # one output: the UDF's value; else a struct of them
        got = scored.select(F.col("out").alias(want.columns[0])).toPandas()
    else:
        got = scored.select("out.*").toPandas()
    assert_same(got, want)


def test_a_fit_with_mlflow_logging_logs_an_mlflow_model_with_signature_and_example(models):
    run_id = models["images_run"]
    uri = f"runs:/{run_id}/model"
    info = mlflow.models.get_model_info(uri)
    assert set(info.flavors) == {"python_function", "spark_estimator"}
    inputs = info.signature.inputs.to_dict()
    assert inputs == [
        {"type": "binary", "name": "content", "required": True},
        {"type": "string", "name": "path", "required": False},  # names rows in errors
    ]
    outputs = [(c["name"], c["type"]) for c in info.signature.outputs.to_dict()]
    assert outputs == [
        ("rawPrediction", "array"),
        ("probability", "array"),
        ("prediction", "double"),
    ]
    folder = Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="model"))
    example = json.loads((folder / "input_example.json").read_text())
    assert example["columns"] == ["content"] and len(example["data"]) == 2
    requirements = (folder / "requirements.txt").read_text().split()
    assert {r.split("==")[0] for r in requirements} >= {
        "mlflow",
        "spark-estimator",
        "torch",
        "pyspark",
        "cloudpickle",
        "Pillow",
        "simplejpeg",
    }
    assert f"torch=={torch.__version__.split('+')[0]}" in requirements
    # the Spark ML stage sits beside MLmodel: TorchModel.load reads the downloaded folder
    loaded = TorchModel.load(str(folder))
    fitted = models["images"][1]
    for a, b in zip(
        loaded.getModel().state_dict().values(), fitted.getModel().state_dict().values()
    ):
        assert torch.equal(a, b)
    # and the weights alone load into the architecture, weights-only (docs/security.md)
    net = TinyCNN()
    net.load_state_dict(torch.load(folder / "weights.pt", weights_only=True))
    assert all(
        torch.equal(a, b)
        for a, b in zip(net.state_dict().values(), fitted.getModel().state_dict().values())
    )


def test_bad_input_to_predict_is_refused_naming_the_column(models, tmp_path):
    classifier = mlflow.pyfunc.load_model(models["classifier"][0])
    with pytest.raises(Exception, match="features"):  # MLflow's signature check
        classifier.predict(pd.DataFrame({"other": [[1.0, 2.0, 3.0, 4.0]]}))
    with pytest.raises(Exception, match="features"):
        classifier.predict(pd.DataFrame({"features": ["not numbers"]}))
    images = mlflow.pyfunc.load_model(models["images"][0])
    bad = pd.DataFrame({"content": [b"no image here"], "path": ["file:/data/broken.png"]})
    with pytest.raises(Exception, match=r"(?s)content.*broken\.png|broken\.png.*content"):
        images.predict(bad)
    # the TorchPyfunc's own checks, which MLflow's signature leaves to it
    model = se_mlflow.load_model(models["images"][0])
    missing = "feature_cols: column 'content' is not in the DataFrame"
    with pytest.raises(MlflowException, match=missing) as raised:
        TorchPyfunc(model).predict(pd.DataFrame({"path": ["x"]}))
    assert raised.value.error_code == "INVALID_PARAMETER_VALUE"  # a server's 400
    with pytest.raises(MlflowException, match="column 'content': row 0 is text that is not base"):
        TorchPyfunc(model).predict(pd.DataFrame({"content": ["a string"]}))
    with pytest.raises(MlflowException, match="column 'content' must hold bytes"):
        TorchPyfunc(model).predict(pd.DataFrame({"content": [1.5]}))


def test_a_model_of_arrays_has_a_tensor_signature_checked_at_once_also_over_rest(models):
    """MLflow checks a tensor signature a column at once (the widths too), an array of a
    column signature row by row; the server's request handler reads its JSON formats."""
    from mlflow.pyfunc import scoring_server

    uri, model, df, want = models["regressor"]
    loaded = mlflow.pyfunc.load_model(uri)
    schema = loaded.metadata.get_input_schema()
    assert schema.is_tensor_spec() and schema.inputs[0].shape == (-1, 3)  # the example's
    with pytest.raises(MlflowException, match=r"column 'x' could not be converted to the exp"):
        loaded.predict(pd.DataFrame({"x": [[1.0, 2.0]]}))
    rows = [[list(x)] for x in df.toPandas()["x"]]
    bodies = [
        {"dataframe_split": {"columns": ["x"], "data": rows}},
        {"inputs": {"x": [row[0] for row in rows]}},
    ]
    for body in bodies:
        answer = scoring_server.invocations(json.dumps(body), "application/json", loaded, schema)
        assert answer.status == 200, answer.response
        assert_same(pd.DataFrame(json.loads(answer.response)["predictions"]), want)


def test_the_pytorch_flavor_gives_the_module_back_when_asked_for(models, tmp_path):
    regressor = models["regressor"][1]
    se_mlflow.save_model(regressor, str(tmp_path / "with"), pytorch_flavor=True)
    module = mlflow.pytorch.load_model(str(tmp_path / "with"))
    assert torch.equal(module.weight, regressor.getModel().weight)
    info = mlflow.models.get_model_info(models["regressor"][0])
    assert "pytorch" not in info.flavors  # by default: one copy of the weights, weights.pt
    assert se_mlflow.load_model(models["regressor"][0]).getModel().weight.shape == (1, 3)


def test_a_model_logged_before_it_was_an_mlflow_model_still_loads(models, tmp_path):
    """mlflow_logging used to log the saved stage alone as run artifacts."""
    regressor = models["regressor"][1]
    regressor.save(str(tmp_path / "stage"))
    with mlflow.start_run() as run:
        mlflow.log_artifacts(str(tmp_path / "stage"), artifact_path="model")
    folder = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="model")
    assert torch.equal(TorchModel.load(folder).getModel().weight, regressor.getModel().weight)
    loaded = se_mlflow.load_model(f"runs:/{run.info.run_id}/model")
    assert torch.equal(loaded.getModel().weight, regressor.getModel().weight)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def invocations(port: int, frame: pd.DataFrame) -> tuple[int, dict]:
    split = json.loads(frame.to_json(orient="split", index=False, default_handler=str))
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/invocations",
        data=json.dumps({"dataframe_split": split}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_mlflow_models_serve_answers_with_the_same_predictions(models, tracking, tmp_path):
    uri, model, df, want = models["images"]
    port = free_port()
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": tracking,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
    }
    command = [sys.executable, "-m", "mlflow", "models", "serve", "-m", uri]
    command += ["--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)]
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        command,
        env=env,
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=5):
                    break
            except OSError:
                assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-3000:]
                time.sleep(0.5)
        pdf = df.toPandas()
        rows = pd.DataFrame(
            {"content": [base64.b64encode(bytes(b)).decode() for b in pdf["content"]]}
        )
        status, answer = invocations(port, rows)
        assert status == 200, answer
        assert_same(pd.DataFrame(answer["predictions"]), want)
        status, answer = invocations(port, rows.head(1))
        assert status == 200 and len(answer["predictions"]) == 1
        assert_same(pd.DataFrame(answer["predictions"]), want.head(1))
        status, answer = invocations(port, pd.DataFrame({"image": rows["content"]}))
        assert status == 400 and "content" in answer["message"], answer
        broken = base64.b64encode(b"no image here").decode()
        status, answer = invocations(port, pd.DataFrame({"content": [broken]}))
        assert status == 400, answer
        assert "column 'content': row 0 of the batch could not be decoded" in answer["message"]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


@pytest.mark.parametrize(
    "kind, names",
    [("classifier", ["probability"]), ("two_heads", ["embedding", "score"])],
)
def test_output_array_gives_the_named_columns_as_one_array_a_row_also_in_spark_udf(
    models, kind, names
):
    """The opt-in form spark_udf converts a batch at once: transform's values, in the order
    named, one array<double> a row (docs/serving.md, Throughput in Spark)."""
    uri, model, df, want = models[kind]
    expected = np.concatenate(
        [np.stack([np.atleast_1d(getattr(v, "toArray", lambda v=v: v)()) for v in want[n]])
         for n in names],
        axis=1,
    )  # fmt: skip
    if kind == "classifier":
        from pyspark.ml.functions import vector_to_array

        df = df.select(vector_to_array("features").alias("features"))
    loaded = mlflow.pyfunc.load_model(uri)
    assert loaded.metadata.get_params_schema().to_dict()[0]["name"] == "output_array"
    got = loaded.predict(df.toPandas(), params={"output_array": names})
    assert got.dtype == np.float64 and got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    udf = mlflow.pyfunc.spark_udf(
        df.sparkSession,
        uri,
        env_manager="local",
        result_type="array<double>",
        params={"output_array": names},
    )
    features = [F.col(c) for c in model.getFeatureCols()]
    rows = df.coalesce(1).select(udf(*features).alias("out")).toPandas()["out"]
    np.testing.assert_allclose(np.stack(rows), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(MlflowException, match=r"output_array: \['nope'\] are not output columns"):
        loaded.predict(df.toPandas(), params={"output_array": ["nope"]})


# -- the user's own code: modules a loading process does not have -------------------------

NET_MODULE = '''
import torch


class UserNet(torch.nn.Module):
    """Defined in the user's own module, not installed anywhere."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.linear = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.linear(x) * SCALE


SCALE = 2.0
'''

DYNAMIC_MODULE = '''
import importlib

import torch


class PluginNet(torch.nn.Module):
    """Imports its plugin by name when it runs: no pickle names it."""

    def __init__(self, plugin):
        super().__init__()
        torch.manual_seed(4)
        self.linear, self.plugin = torch.nn.Linear(3, 1), plugin

    def forward(self, x):
        return importlib.import_module(self.plugin).shift(self.linear(x))
'''


@pytest.fixture
def user_modules(tmp_path):
    """``usernet_<id>`` (a model class) and ``pluginnet_<id>`` (a model that imports the
    module ``plugin_<id>`` by name), in folders on sys.path for this test only; their
    names."""
    tag = tmp_path.name.replace("-", "_")
    src, plugins = tmp_path / "src", tmp_path / "plugins"
    src.mkdir()
    plugins.mkdir()
    (src / f"usernet_{tag}.py").write_text(NET_MODULE)
    (src / f"pluginnet_{tag}.py").write_text(DYNAMIC_MODULE)
    (plugins / f"plugin_{tag}.py").write_text("def shift(y):\n    return y + 10\n")
    sys.path[:0] = [str(src), str(plugins)]
    try:
        yield {"net": f"usernet_{tag}", "dynamic": f"pluginnet_{tag}", "plugin": f"plugin_{tag}"}
    finally:
        sys.path[:] = [p for p in sys.path if p not in (str(src), str(plugins))]
        for name in [n for n in sys.modules if tag in n]:
            del sys.modules[name]


PREDICT_ELSEWHERE = """
import importlib.util, json, sys
import mlflow, pandas as pd
hidden = json.loads(sys.argv[3])
assert not any(importlib.util.find_spec(m) for m in hidden), "this process has the module"
mlflow.set_tracking_uri(sys.argv[1])
model = mlflow.pyfunc.load_model(sys.argv[2])
rows = json.loads(sys.stdin.read())
out = model.predict(pd.DataFrame({"x": rows}))
print(json.dumps(out["prediction"].tolist()))
"""


def predict_elsewhere(tracking: str, uri: str, x: list, hidden: list[str], tmp_path):
    """``mlflow.pyfunc.load_model(uri).predict`` of the rows ``x`` in a fresh Python whose
    sys.path holds none of the modules ``hidden`` (checked there)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-c", PREDICT_ELSEWHERE, tracking, uri, json.dumps(hidden)],
        input=json.dumps(x),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )


def one_epoch_estimator(net, store: Store, **params) -> TorchEstimator:
    """One epoch of ``net`` on columns x -> y, on one process, quietly."""
    return TorchEstimator(
        model=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["y"],
        batch_size=4,
        epochs=1,
        num_proc=1,
        use_gpu=False,
        verbose=False,
        store=store,
        **params,
    )


def test_a_model_class_of_the_users_own_module_loads_where_that_module_is_not(
    models, tracking, user_modules, tmp_path
):
    """Logged by mlflow_logging after a fit (the module shipped to the executors with
    addPyFile) and saved by save_model: its module travels in code/, found in the pickle."""
    import importlib

    module = importlib.import_module(user_modules["net"])
    spark = spark_session(LOCAL)
    spark.sparkContext.addPyFile(module.__file__)  # as --py-files ships it to executors
    rows = [[float(i), 1.0 - i, 0.5 * i] for i in range(8)]
    df = spark.createDataFrame([(r, float(sum(r))) for r in rows], "x array<double>, y double")
    store = Store.create(str(tmp_path / "store"))
    with mlflow.start_run() as run:
        fitted = one_epoch_estimator(module.UserNet(), store, mlflow_logging=True).fit(df)
    want = fitted.transform(df).select("prediction").toPandas()["prediction"].tolist()
    saved = tmp_path / "saved"
    se_mlflow.save_model(fitted, str(saved))
    assert (saved / "code" / f"{user_modules['net']}.py").read_text() == NET_MODULE
    for uri in (f"runs:/{run.info.run_id}/model", str(saved)):
        done = predict_elsewhere(tracking, uri, rows, [user_modules["net"]], tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        np.testing.assert_allclose(json.loads(done.stdout), want, rtol=1e-5, atol=1e-6)


def test_mlflow_code_paths_ship_with_the_model_mlflow_logging_logs(
    tracking, user_modules, tmp_path
):
    """``mlflow_code_paths`` reaches the model ``mlflow_logging`` logs (a plugin imported by
    name in forward, which no pickle names); refused before any job without
    ``mlflow_logging`` or for a path that is not there."""
    import importlib

    module = importlib.import_module(user_modules["dynamic"])
    plugin = importlib.import_module(user_modules["plugin"])
    spark = spark_session(LOCAL)
    for shipped in (module, plugin):  # as --py-files ships them to executors
        spark.sparkContext.addPyFile(shipped.__file__)
    rows = [[float(i), 1.0 - i, 0.5 * i] for i in range(8)]
    df = spark.createDataFrame([(r, float(sum(r))) for r in rows], "x array<double>, y double")
    net = module.PluginNet(user_modules["plugin"])
    store = Store.create(str(tmp_path / "store"))
    estimator = functools.partial(one_epoch_estimator, net, store)

    with pytest.raises(ValueError, match="mlflow_code_paths: given without mlflow_logging=True"):
        estimator(mlflow_code_paths=[plugin.__file__]).fit(df)
    with pytest.raises(ValueError, match=r"mlflow_code_paths: \['nowhere.py'\] do not exist"):
        estimator(mlflow_logging=True, mlflow_code_paths=["nowhere.py"]).fit(df)
    assert not store.fs.exists(store.datasets)  # both before any job
    with mlflow.start_run() as run:
        fitted = estimator(mlflow_logging=True, mlflow_code_paths=[plugin.__file__]).fit(df)
    want = fitted.transform(df).select("prediction").toPandas()["prediction"].tolist()
    hidden = [user_modules["dynamic"], user_modules["plugin"]]
    done = predict_elsewhere(tracking, f"runs:/{run.info.run_id}/model", rows, hidden, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    np.testing.assert_allclose(json.loads(done.stdout), want, rtol=1e-5, atol=1e-6)


def test_code_paths_ship_what_no_pickle_names_and_are_checked(tracking, user_modules, tmp_path):
    import importlib

    module = importlib.import_module(user_modules["dynamic"])
    model = TorchModel(
        model=module.PluginNet(user_modules["plugin"]),
        feature_cols=["x"],
        output_shapes=[[1]],
        feature_kinds={"x": ["array", "float32"]},
    )
    rows = [[float(i), -1.0, 0.25 * i] for i in range(5)]
    x = torch.tensor(rows)
    want = (model.getModel()(x)).squeeze(1).tolist()
    plugin = str(tmp_path / "plugins" / f"{user_modules['plugin']}.py")
    hidden = [user_modules["dynamic"], user_modules["plugin"]]
    without = se_mlflow.log_model(model, "without").model_uri
    done = predict_elsewhere(tracking, without, rows, hidden, tmp_path)
    assert done.returncode != 0 and f"No module named '{user_modules['plugin']}'" in done.stderr
    with_code = se_mlflow.log_model(model, "with", code_paths=[plugin]).model_uri
    done = predict_elsewhere(tracking, with_code, rows, hidden, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    np.testing.assert_allclose(json.loads(done.stdout), want, rtol=1e-5, atol=1e-6)
    # spark_estimator.mlflow.load_model puts code/ on sys.path too
    sys.path.remove(str(tmp_path / "plugins"))
    del sys.modules[user_modules["plugin"]]
    assert se_mlflow.load_model(with_code).getModel()(x).squeeze(1).tolist() == want
    with pytest.raises(ValueError, match=r"code_paths: \['nowhere.py'\] do not exist"):
        se_mlflow.save_model(model, str(tmp_path / "bad"), code_paths=["nowhere.py"])
    with pytest.raises(TypeError, match="code_paths: a list of paths"):
        se_mlflow.save_model(model, str(tmp_path / "bad"), code_paths=plugin)
    assert not (tmp_path / "bad").exists()
