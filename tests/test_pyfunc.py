"""TorchPyfunc, the MLflow model's python_function, on its own (no tracking store): Spark's
image structs, batching, empty input, what it refuses."""

from __future__ import annotations

import base64

import numpy as np
import pandas as pd
import pytest
import torch
from pyspark.sql import Row
from pyspark.sql.types import StructField, StructType

from spark_estimator import TorchModel
from tests.conftest import linear_net

pytest.importorskip("mlflow")
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
