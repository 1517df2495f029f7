"""TorchPyfunc, the MLflow model's python_function, on its own (no tracking store): Spark's
image structs, batching, empty input, what it refuses; NaN and infinite features and binary
columns in transform, predict and a real ``mlflow models serve`` of a saved model folder, in
each of MLflow's four JSON forms."""

from __future__ import annotations

import base64
import io
import json
import logging
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
from pyspark.sql import Row
from pyspark.sql.types import StructField, StructType

from spark_estimator import TorchModel
from tests.conftest import LOCAL, linear_net, spark_session

mlflow = pytest.importorskip("mlflow")
from mlflow.exceptions import MlflowException  # noqa: E402

from spark_estimator import mlflow as se_mlflow  # noqa: E402
from spark_estimator import pyfunc  # noqa: E402
from spark_estimator.driver.mlflow_model import IMAGE_STRUCT  # noqa: E402


class Brightness(torch.nn.Module):
    """uint8 RGB images [B, 3, H, W] -> their mean of each channel [B, 3]."""

    def forward(self, image):
        return image.float().mean((2, 3)) / 255


def test_spark_image_structs_predict_what_transform_appends_also_with_base64_data(spark):
    rng = np.random.default_rng(0)
    rows = [
        Row(image=Row(f"file:/i/{i}.png", 4, 4, 3, 16, bytes(rng.integers(0, 255, 48, np.uint8))))
        for i in range(3)
    ]
    df = spark.createDataFrame(rows, StructType([StructField("image", IMAGE_STRUCT)]))
    model = TorchModel(
        model=Brightness(),
        feature_cols=["image"],
        output_shapes=[[3]],
        feature_kinds={"image": ["image", "float32"]},
    )
    want = np.stack(model.transform(df).toPandas()["prediction"])
    pdf = df.toPandas()
    got = pyfunc.TorchPyfunc(model).predict(pdf)
    np.testing.assert_allclose(np.stack(got["prediction"]), want, rtol=1e-6)
    # over REST, MLflow's JSON holds the struct's bytes as base64 text
    pdf["image"] = [
        {**image, "data": base64.b64encode(image["data"]).decode()} for image in pdf["image"]
    ]
    got = pyfunc.TorchPyfunc(model).predict(pdf)
    np.testing.assert_allclose(np.stack(got["prediction"]), want, rtol=1e-6)


class Counting(torch.nn.Module):
    """A linear regressor that records the rows of each batch it is given."""

    def __init__(self):
        super().__init__()
        self.net, self.batches = linear_net(), []

    def forward(self, x):
        self.batches.append(len(x))
        return self.net(x)


def counting_model() -> TorchModel:
    return TorchModel(
        model=Counting(),
        feature_cols=["x"],
        output_shapes=[[1]],
        feature_kinds={"x": ["array", "float32"]},
    )


def test_rows_run_in_batches_of_batch_rows_in_order(monkeypatch):
    monkeypatch.setattr(pyfunc, "BATCH_ROWS", 2)
    model = counting_model()
    x = np.arange(15, dtype=np.float64).reshape(5, 3)
    got = pyfunc.TorchPyfunc(model).predict(pd.DataFrame({"x": list(x)}))
    assert model.getModel().batches == [2, 2, 1]
    with torch.no_grad():
        want = model.getModel().net(torch.tensor(x, dtype=torch.float32)).squeeze(1)
    np.testing.assert_allclose(got["prediction"], want.numpy(), rtol=1e-6)
    assert got["prediction"].dtype == np.float64  # a double column, as transform's


def test_no_rows_give_no_rows_with_the_output_columns():
    got = pyfunc.TorchPyfunc(counting_model()).predict(pd.DataFrame({"x": []}))
    assert list(got.columns) == ["prediction"] and len(got) == 0


def test_ml_vectors_and_lists_are_read_alike_and_strings_are_refused_naming_the_column():
    from pyspark.ml.linalg import Vectors

    model = counting_model()
    rows = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    lists = pyfunc.TorchPyfunc(model).predict(pd.DataFrame({"x": rows}))
    vectors = pyfunc.TorchPyfunc(model).predict(
        pd.DataFrame({"x": [Vectors.dense(r) for r in rows]})
    )
    arrays = pyfunc.TorchPyfunc(model).predict(  # as Spark hands them over: stacked at once
        pd.DataFrame({"x": list(np.array(rows, dtype=np.float32))})
    )
    assert lists["prediction"].tolist() == vectors["prediction"].tolist()
    assert lists["prediction"].tolist() == arrays["prediction"].tolist()
    with pytest.raises(MlflowException, match=r"feature_cols: column 'x' \(object\) cannot be"):
        pyfunc.TorchPyfunc(model).predict(pd.DataFrame({"x": ["1, 2, 3"]}))


def test_a_dict_of_rows_of_values_as_a_tensor_signature_hands_on_predicts_as_a_dataframe():
    model = counting_model()
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    frame = pyfunc.TorchPyfunc(model).predict(pd.DataFrame({"x": list(x)}))
    tensors = pyfunc.TorchPyfunc(model).predict({"x": x})
    assert tensors["prediction"].tolist() == frame["prediction"].tolist()
    empty = pyfunc.TorchPyfunc(model).predict({"x": np.zeros((0, 3), np.float32)})
    assert list(empty.columns) == ["prediction"] and len(empty) == 0
    with pytest.raises(MlflowException, match=r"column 'x' \(<U1 arrays\) cannot be read"):
        pyfunc.TorchPyfunc(model).predict({"x": np.full((2, 3), "a")})


def test_gpu_decoding_where_predict_runs_on_the_cpu_is_refused_naming_decode_device():
    model = TorchModel(
        model=Brightness(),
        feature_cols=["content"],
        decode_device="cuda",
        feature_kinds={"content": ["binary", "float32"]},
    )
    if torch.cuda.is_available():
        pytest.skip("predict runs on the GPU here")
    with pytest.raises(MlflowException, match="decode_device: 'cuda', but predict runs on the CPU"):
        pyfunc.TorchPyfunc(model).predict(pd.DataFrame({"content": [b"\xff\xd8"]}))


def test_a_model_config_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"model_config: .* takes none \(given: \['device'\]\)"):
        se_mlflow._load_pyfunc(str(tmp_path), {"device": "cpu"})


# -- NaN and infinite features: prediction NaN, a warning naming the column ------------------


class Pair(torch.nn.Module):
    """Two scalar columns a, b -> the class logits [a, b]."""

    def forward(self, a, b):
        return torch.stack([a, b], 1)


class Scaled(torch.nn.Module):
    """An array column x [B, 2] and a scalar a -> the class logits x * a."""

    def forward(self, x, a):
        return x * a.unsqueeze(1)


def scalar_classifier() -> TorchModel:
    kinds = {"a": ["scalar", "float32"], "b": ["scalar", "float32"]}
    return TorchModel(
        model=Pair(),
        feature_cols=["a", "b"],
        classification=True,
        output_shapes=[[2]],
        feature_kinds=kinds,
    )


def mixed_classifier() -> TorchModel:
    kinds = {"x": ["array", "float32"], "a": ["scalar", "float32"]}
    return TorchModel(
        model=Scaled(),
        feature_cols=["x", "a"],
        classification=True,
        output_shapes=[[2]],
        feature_kinds=kinds,
        feature_lengths={"x": 2},
    )


NAN, INF = float("nan"), float("inf")


def non_finite_rows(kind: str) -> pd.DataFrame:
    """Rows of finite features and of NaN, +inf and -inf in each feature column."""
    if kind == "scalars":
        return pd.DataFrame({"a": [2.0, NAN, 1.0, -INF, 0.5], "b": [1.0, 1.0, INF, 0.0, 3.0]})
    x = [[1.0, 2.0], [NAN, 1.0], [3.0, 1.0], [1.0, -INF], [2.0, 1.0], [1.0, 0.5]]
    return pd.DataFrame({"x": x, "a": [1.0, 1.0, INF, 1.0, NAN, -INF]})


def class_frame(scored) -> pd.DataFrame:
    """transform's classifier columns as pandas, ML vectors as arrays."""
    pdf = scored.select("rawPrediction", "probability", "prediction").toPandas()
    for name in ("rawPrediction", "probability"):
        pdf[name] = [v.toArray() for v in pdf[name]]
    return pdf


def assert_same_classes(got: pd.DataFrame, want: pd.DataFrame) -> None:
    """The same columns and values, NaN where the other has NaN."""
    assert list(got.columns) == list(want.columns) and len(got) == len(want)
    for name in want.columns:
        expect = np.stack([np.asarray(v, dtype=np.float64) for v in want[name]])
        found = np.stack([np.asarray(v, dtype=np.float64) for v in got[name]])
        np.testing.assert_allclose(found, expect, rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("kind", ["scalars", "mixed"])
def test_non_finite_features_give_prediction_nan_in_transform_and_predict_alike(
    spark, kind, tmp_path, caplog
):
    """A row whose logits are not finite gets prediction NaN, not a class, in transform
    and in predict (a scalar column's NaN is a NaN there too, not a refused null), for a
    column signature (numbers alone) and a tensor signature (an array beside them); a
    warning names the column."""
    model = scalar_classifier() if kind == "scalars" else mixed_classifier()
    rows = non_finite_rows(kind)
    schema = "a double, b double" if kind == "scalars" else "x array<double>, a double"
    df = spark.createDataFrame(list(rows.itertuples(index=False)), schema)  # NaN, not null
    want = class_frame(model.transform(df))
    bad = [1, 2, 3] if kind == "scalars" else [1, 2, 3, 4, 5]
    assert want["prediction"].isna().tolist() == [i in bad for i in range(len(rows))]
    se_mlflow.save_model(model, str(tmp_path / "model"), input_example=rows.head(1))
    loaded = mlflow.pyfunc.load_model(str(tmp_path / "model"))
    signature = loaded.metadata.get_input_schema()
    assert signature.is_tensor_spec() == (kind == "mixed")
    with caplog.at_level(logging.WARNING, logger="spark_estimator"):
        assert_same_classes(loaded.predict(rows), want)
    named = [r.getMessage() for r in caplog.records if "NaN or infinite" in r.getMessage()]
    column = "a" if kind == "scalars" else "x"
    assert len(named) == 1 and f"column '{column}' holds NaN or infinite values in" in named[0]
    assert "of 5 rows (predict)" in named[0] or "of 6 rows (predict)" in named[0]


# -- over REST: a real `mlflow models serve`, every JSON form ----------------------------------

ROOT = Path(__file__).resolve().parents[1]
FORMS = ["dataframe_split", "dataframe_records", "inputs", "instances"]


class MeanClassifier(torch.nn.Module):
    """uint8 RGB images [B, 3, H, W] -> 2 class logits of their channel means."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.out = torch.nn.Linear(3, 2)

    def forward(self, images):
        return self.out(images.float().mean((2, 3)) / 255)


def read_image(row, augment):
    """decode_fn of the binary column ``content``: the image, 8x8 RGB."""
    from spark_estimator.decoding import decode_image

    return {"content": decode_image(row["content"], mode="RGB", size=(8, 8))}


def image_classifier(decode_fn=None) -> TorchModel:
    return TorchModel(
        model=MeanClassifier(),
        feature_cols=["content"],
        classification=True,
        output_shapes=[[2]],
        feature_kinds={"content": ["binary", "float32"]},
        decode_fn=decode_fn,
    )


def encoded_images() -> list[bytes]:
    """8x8 RGB pictures, PNG and JPEG."""
    Image = pytest.importorskip("PIL.Image", reason="needs Pillow (the vision extra)")
    rng = np.random.default_rng(0)
    out = []
    for i in range(4):
        pixels = (rng.integers(0, 100, (8, 8, 3)) + 100 * (i % 2)).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG" if i % 2 else "JPEG")
        out.append(buffer.getvalue())
    return out


def request_body(frame: pd.DataFrame, form: str) -> bytes:
    """``frame`` as a request of MLflow's JSON ``form`` (NaN and infinity as Python's json
    writes them, bytes as base64 text)."""

    def value(v):
        if isinstance(v, bytes):
            return base64.b64encode(v).decode()
        return v.tolist() if isinstance(v, np.ndarray) else v

    columns = list(frame.columns)
    rows = [[value(v) for v in row] for row in frame.itertuples(index=False)]
    records = [dict(zip(columns, row)) for row in rows]
    body = {
        "dataframe_split": {"columns": columns, "data": rows},
        "dataframe_records": records,
        "inputs": {c: [row[i] for row in rows] for i, c in enumerate(columns)},
        "instances": records,
    }[form]
    return json.dumps({form: body}).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """``mlflow models serve`` of a model folder on 127.0.0.1 (started by ``start``, ready
    once ``wait`` returns), its output in ``log``."""

    def __init__(self, folder: Path):
        self.port, self.log = free_port(), folder.parent / f"{folder.name}.log"
        env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(ROOT),
        }
        command = [sys.executable, "-m", "mlflow", "models", "serve", "-m", str(folder)]
        command += ["--env-manager", "local", "-h", "127.0.0.1", "-p", str(self.port)]
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait(self) -> None:
        deadline = time.monotonic() + 300
        while True:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/ping", timeout=5):
                    return
            except OSError:
                assert time.monotonic() < deadline, self.log.read_text()[-3000:]
                time.sleep(0.5)

    def post(self, body: bytes) -> tuple[int, dict]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/invocations",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """name -> (Served, the rows it is asked about, what transform appends to them): a
    classifier of two scalar columns (a column signature), of an array and a scalar (a
    tensor signature), of images by the default decoding and by a decode_fn."""
    pytest.importorskip("flask", reason="needs full mlflow (the serving extra)")
    images = pd.DataFrame({"content": encoded_images()})
    models = {
        "scalars": (scalar_classifier(), non_finite_rows("scalars")),
        "mixed": (mixed_classifier(), non_finite_rows("mixed")),
        "images": (image_classifier(), images),
        "images_fn": (image_classifier(read_image), images),
    }
    folder = tmp_path_factory.mktemp("served")
    servers = {}
    try:
        for name, (model, rows) in models.items():
            se_mlflow.save_model(model, str(folder / name), input_example=rows.head(2))
            servers[name] = Served(folder / name)
        spark = spark_session(LOCAL)
        schemas = {
            "scalars": "a double, b double",
            "mixed": "x array<double>, a double",
            "images": "content binary",
            "images_fn": "content binary",
        }
        found = {}
        for name, (model, rows) in models.items():
            df = spark.createDataFrame(list(rows.itertuples(index=False)), schemas[name])
            found[name] = (servers[name], rows, class_frame(model.transform(df)))
        for server in servers.values():
            server.wait()
        yield found
    finally:
        for server in servers.values():
            server.stop()


def predictions(answer: dict) -> pd.DataFrame:
    return pd.DataFrame(answer["predictions"])


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", ["scalars", "mixed"])
def test_non_finite_features_over_rest_give_prediction_nan_as_transform(served, kind, form):
    server, rows, want = served[kind]
    assert want["prediction"].isna().any() and want["prediction"].notna().any()
    status, answer = server.post(request_body(rows, form))
    assert status == 200, answer
    assert_same_classes(predictions(answer), want)
    assert "NaN or infinite values in" in server.log.read_text()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", ["images", "images_fn"])
def test_images_over_rest_in_every_form_predict_what_transform_appends(served, kind, form):
    """Base64 text in a binary column is decoded in every JSON form (MLflow decodes it in
    the dataframe_* forms only), for the default image decoding and a decode_fn."""
    server, rows, want = served[kind]
    status, answer = server.post(request_body(rows, form))
    assert status == 200, answer
    assert_same_classes(predictions(answer), want)
    status, answer = server.post(request_body(rows.head(1), form))
    assert status == 200, answer
    assert_same_classes(predictions(answer), want.head(1))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", ["images", "images_fn"])
def test_bytes_that_are_not_an_image_are_refused_saying_what_to_send(served, kind, form):
    server, rows, _ = served[kind]
    expects = (
        "an image file's bytes (PNG, JPEG, ...: binaryFile's content)"
        if kind == "images"
        else "the bytes its decode_fn reads"
    )
    status, answer = server.post(request_body(pd.DataFrame({"content": [b"no image"]}), form))
    assert status == 400, answer
    message = answer["message"]
    assert "column 'content'" in message and "row 0" in message, message
    assert f"column 'content' expects {expects}, as bytes in Python and base64" in message
    # text that is not base64: MLflow's own decoding refuses it in the dataframe_* forms
    text = {"dataframe_split": {"columns": ["content"], "data": [["not base64!"]]}}
    if form in ("inputs", "instances"):
        text = {
            form: {"content": ["not base64!"]} if form == "inputs" else [{"content": "not base64!"}]
        }
    status, answer = server.post(json.dumps(text).encode())
    assert status == 400, answer
    if form in ("inputs", "instances"):
        assert f"column 'content' expects {expects}" in answer["message"], answer
    status, answer = server.post(request_body(rows.head(1), form))
    assert status == 200, answer  # still answering


def test_a_frame_without_index_label_0_predicts_as_with_a_default_index(tmp_path):
    """MLflow 3's check of a tensor signature reads a column's first value by position: a
    filtered frame (no label 0) needs no reset_index."""
    rows = pd.DataFrame({"x": [[1.0, 2.0], [3.0, 1.0], [2.0, 2.5]], "a": [1.0, 0.5, 2.0]})
    se_mlflow.save_model(mixed_classifier(), str(tmp_path / "model"), input_example=rows)
    loaded = mlflow.pyfunc.load_model(str(tmp_path / "model"))
    assert loaded.metadata.get_input_schema().is_tensor_spec()
    want = loaded.predict(rows.iloc[1:].reset_index(drop=True))
    got = loaded.predict(rows.iloc[1:])  # index [1, 2]
    assert_same_classes(got.reset_index(drop=True), want)


def test_a_fitted_model_without_a_decode_fn_asks_for_an_image_file(tmp_path):
    """A fit sets the decoding params it was given, decode_fn=None among them: the default
    decoding's message, not a decode_fn's."""
    model = image_classifier()
    model._set(decode_fn=None, decode_batch_fn=None)
    with pytest.raises(MlflowException) as raised:
        pyfunc.TorchPyfunc(model).predict(pd.DataFrame({"content": [b"no image"]}))
    assert "column 'content' expects an image file's bytes (PNG, JPEG" in str(raised.value)
    with pytest.raises(MlflowException, match="column 'content' expects the bytes its decode_fn"):
        pyfunc.TorchPyfunc(image_classifier(read_image)).predict(
            pd.DataFrame({"content": [b"no image"]})
        )
