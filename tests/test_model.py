"""TorchModel.transform and save/load on a real local[4] Spark session."""

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from pyspark.ml.linalg import Vectors
from pyspark.sql import functions as F

from spark_estimator import Store, TorchEstimator, TorchModel
from spark_estimator.callbacks import EarlyStopping
from tests.conftest import linear_net, make_estimator, regression_rows


def fixed_net():
    net = torch.nn.Linear(3, 2)
    with torch.no_grad():
        net.weight.copy_(torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 1.0]]))
        net.bias.copy_(torch.tensor([0.5, -1.0]))
    return net


def test_transform_adds_outputs_keeps_inputs_and_matches_torch(spark):
    df = spark.createDataFrame(
        [(Vectors.dense([1.0, 2.0, 3.0]), "a"), (Vectors.sparse(3, [2], [4.0]), "b")],
        ["features", "tag"],
    ).repartition(2)
    model = TorchModel(model=fixed_net(), feature_cols=["features"], output_shapes=[[2]])
    out = model.transform(df)
    assert out.columns == ["features", "tag", "prediction"]
    assert dict(out.dtypes)["features"] == "vector"
    rows = {r.tag: (r.features, r.prediction) for r in out.collect()}
    assert rows["a"][1] == pytest.approx([1.5, 6.0]) and rows["b"][1] == pytest.approx([0.5, 3.0])
    assert rows["b"][0] == Vectors.sparse(3, [2], [4.0])


class MinusTwoTo24(torch.nn.Module):
    """x[:, 0] - 2**24 and x[:, 1] - 2**24, as a float64 model computes them."""

    def forward(self, x):
        assert x.dtype == torch.float64
        return (x[:, 0] - 2**24) + (x[:, 1] - 2**24) * 10


def test_a_float64_model_predicts_on_vector_features_not_rounded_to_float32(spark):
    big = 2.0**24 + 1  # not a float32: rounded, x - 2**24 would be 0, not 1
    df = spark.createDataFrame(
        [(Vectors.dense([big, big + 2]), "dense"), (Vectors.sparse(2, [0], [big]), "sparse")],
        ["features", "tag"],
    )
    model = TorchModel(
        model=MinusTwoTo24(), feature_cols=["features"], output_shapes=[[]], dtype="float64"
    )
    rows = {r.tag: r.prediction for r in model.transform(df).collect()}
    assert rows == {"dense": 1.0 + 30.0, "sparse": 1.0 - 2**24 * 10}


def test_output_cols_rename_and_scalar_outputs_are_doubles(spark):
    df = spark.createDataFrame([([1.0, 1.0, 1.0],), ([0.0, 0.0, 2.0],)], "x array<double>")
    net = linear_net(3, 1)
    model = TorchModel(model=net, feature_cols=["x"], output_cols=["score"], output_shapes=[[1]])
    out = model.transform(df)
    assert dict(out.dtypes)["score"] == "double"
    expected = net(torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 2.0]])).squeeze(1).tolist()
    assert [r.score for r in out.collect()] == pytest.approx(expected)


@pytest.mark.parametrize("shape", [[-1, 1, 8, 8], [1, 8, 8]])
def test_input_shapes_apply_in_transform(spark, shape):
    class Sum2d(torch.nn.Module):
        def forward(self, x):
            assert x.dim() == 4
            return x.sum(dim=(1, 2, 3))

    df = spark.createDataFrame([([1.0] * 64,)], "img array<float>")
    model = TorchModel(
        model=Sum2d(), feature_cols=["img"], input_shapes=[shape], output_shapes=[[]]
    )
    assert model.transform(df).first().prediction == 64.0


class PairSums(torch.nn.Module):
    """Sums the batch's values two by two: one output row per two input rows."""

    def forward(self, x):
        return x.reshape(-1, 2).sum(1)


def test_transform_refuses_outputs_without_one_row_per_input_row(spark):
    df = spark.createDataFrame([(float(i),) for i in range(4)], "x double").coalesce(1)
    model = TorchModel(model=PairSums(), feature_cols=["x"], output_shapes=[[]])
    with pytest.raises(Exception, match=r"the model's output 'prediction' has shape \[2\] for "):
        model.transform(df).collect()


def test_transform_refuses_input_shapes_that_cannot_hold_a_row_before_any_job(spark):
    df = spark.createDataFrame([(float(i),) for i in range(4)], "x double")
    model = TorchModel(model=PairSums(), feature_cols=["x"], output_shapes=[[]])
    for shape, message in (
        ([2], r"input_shapes: shape \[2\] has 2 elements per row, but column 'x' has"),
        ([-1, 2], r"input_shapes: shape \[-1, 2\] has 2 elements per row, but column 'x' has"),
    ):
        with pytest.raises(ValueError, match=message):
            model.setInputShapes([shape]).transform(df)


def test_transform_errors_name_the_column(spark):
    df = spark.createDataFrame([([1.0, 2.0, 3.0], 1.0)], "x array<double>, prediction double")
    model = TorchModel(model=linear_net(), feature_cols=["x"])
    with pytest.raises(ValueError, match=r"output_cols: \['prediction'\] already exist"):
        model.transform(df)
    with pytest.raises(ValueError, match="feature_cols: column 'z'"):
        model.setFeatureCols(["z"]).transform(df)


def test_save_and_load_in_a_fresh_python_process(spark, tmp_path):
    history = [{"epoch": 1, "train": {"loss": 0.5}}]
    model = TorchModel(
        model=fixed_net(),
        feature_cols=["x"],
        output_cols=["out"],
        history=history,
        output_shapes=[[2]],
        run_id="r1",
        training_summary={"selected_epoch": 1},
    )
    path, est_path = str(tmp_path / "model"), str(tmp_path / "est")
    model.save(path)
    make_estimator(epochs=4).save(est_path)
    script = textwrap.dedent(
        f"""
        import os, sys, json
        os.environ["PYSPARK_PYTHON"] = sys.executable
        from pyspark.sql import SparkSession
        from spark_estimator import TorchEstimator, TorchModel
        spark = SparkSession.builder.master("local[1]").getOrCreate()
        m = TorchModel.load({path!r})
        est = TorchEstimator.load({est_path!r})
        df = spark.createDataFrame([([1.0, 2.0, 3.0],)], "x array<double>")
        print(json.dumps({{"uid": m.uid, "history": m.getHistory(), "run": m.getRunId(),
                          "summary": m.getTrainingSummary(),
                          "out": m.transform(df).first().out, "cols": m.getOutputCols(),
                          "est_epochs": est.getEpochs(),
                          "est_model": type(est.getModel()).__name__}}))
        spark.stop()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded["uid"] == model.uid and loaded["history"] == history
    assert loaded["run"] == "r1" and loaded["cols"] == ["out"]
    assert loaded["summary"] == {"selected_epoch": 1}
    assert loaded["out"] == pytest.approx([1.5, 6.0])
    assert loaded["est_epochs"] == 4 and loaded["est_model"] == "Linear"


def test_save_refuses_an_existing_path_unless_overwrite(spark, tmp_path):
    path = str(tmp_path / "model")
    TorchModel(model=fixed_net(), feature_cols=["x"]).save(path)
    with pytest.raises(FileExistsError, match="path: .* already exists"):
        TorchModel(model=linear_net(), feature_cols=["x"]).save(path)
    assert torch.equal(TorchModel.load(path).getModel().weight, fixed_net().weight)
    TorchModel(model=linear_net(3, 2, seed=5), feature_cols=["y"]).write().overwrite().save(path)
    assert TorchModel.load(path).getFeatureCols() == ["y"]


def double_labels(batch):
    return {**batch, "y": batch["y"] * 2}


def test_estimator_save_and_load_keeps_params_and_the_optimizer_bound(spark, tmp_path):
    net = linear_net()
    store = Store.create(str(tmp_path / "store"))
    est = TorchEstimator(
        model=net,
        optimizer=torch.optim.Adam([{"params": [net.weight]}, {"params": [net.bias], "lr": 0.5}]),
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["y"],
        input_shapes=[[-1, 3]],
        batch_size=7,
        epochs=4,
        validation=0.3,
        store=store,
        compression="zstd",
        shuffle_buffer_size=64,
        train_steps_per_epoch=5,
        transformation_fn=double_labels,
        lr_scaling="linear",
        loss_weights=[2.0],
        metrics={"mae": torch.nn.functional.l1_loss},
        callbacks=[EarlyStopping(patience=5)],
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2),
    )
    path = str(tmp_path / "est")
    est.save(path)
    back = TorchEstimator.load(path)
    assert back.uid == est.uid
    for name in (
        "feature_cols",
        "label_cols",
        "input_shapes",
        "batch_size",
        "epochs",
        "validation",
        "num_proc",
        "random_seed",
        "use_gpu",
        "compression",
        "shuffle_buffer_size",
        "train_steps_per_epoch",
        "lr_scaling",
        "loss_weights",
    ):
        assert back.getOrDefault(name) == est.getOrDefault(name), name
    assert back.getMetrics() == {"mae": torch.nn.functional.l1_loss}
    assert back.getCallbacks()[0].patience == 5
    assert back.getLrScheduler()(back.getOptimizer()).step_size == 2
    doubled = back.getTransformationFn()({"y": torch.ones(2)})["y"]
    assert doubled.tolist() == [2.0, 2.0]
    assert back.getStore().url == store.url
    opt, model = back.getOptimizer(), back.getModel()
    assert [g.get("lr") for g in opt.param_groups] == [1e-3, 0.5]
    bound = {id(p) for g in opt.param_groups for p in g["params"]}
    assert bound == {id(p) for p in model.parameters()}
    assert torch.equal(model.weight, net.weight)
    with pytest.raises(TypeError, match="holds a spark_estimator.estimator.TorchEstimator"):
        TorchModel.load(path)


def test_loaded_estimator_trains(spark, tmp_path, regression_df):
    est = make_estimator(epochs=2, store=Store.create(str(tmp_path / "store")))
    est.save(str(tmp_path / "est"))
    model = TorchEstimator.load(str(tmp_path / "est")).fit(regression_df)
    assert len(model.getHistory()) == 2
    assert model.transform(regression_df).where(F.col("prediction").isNull()).count() == 0


def test_a_model_saved_with_its_weights_inside_the_pickle_still_loads(spark, tmp_path):
    """Models saved before weights.pt had the tensors in objects.pkl."""
    import cloudpickle

    from spark_estimator.driver.persistence import OBJECTS_FILE, WEIGHTS_FILE

    path = tmp_path / "model"
    TorchModel(model=fixed_net(), feature_cols=["x"]).save(str(path))
    (path / WEIGHTS_FILE).unlink()
    (path / OBJECTS_FILE).write_bytes(cloudpickle.dumps({"model": fixed_net()}))
    assert torch.equal(TorchModel.load(str(path)).getModel().weight, fixed_net().weight)


# -- classification output ------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]


def class_net():
    net = torch.nn.Linear(2, 3)
    with torch.no_grad():
        net.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]))
        net.bias.zero_()
    return net


def test_classification_adds_spark_classifier_columns(spark):
    x = [[2.0, 0.0], [0.0, 3.0], [-1.0, -2.0], [0.5, 0.4]]
    df = spark.createDataFrame([(v, i) for i, v in enumerate(x)], "x array<double>, id long")
    model = TorchModel(
        model=class_net(), feature_cols=["x"], classification=True, output_shapes=[[3]]
    )
    out = model.transform(df)
    assert out.columns == ["x", "id", "rawPrediction", "probability", "prediction"]
    types = dict(out.dtypes)
    assert (types["rawPrediction"], types["probability"], types["prediction"]) == (
        "vector",
        "vector",
        "double",
    )
    migration = (ROOT / "docs/horovod.md").read_text()  # says what a Horovod user gets
    assert "it adds `rawPrediction` and `probability` (ML `Vector`s)" in migration
    logits = class_net()(torch.tensor(x)).double()
    got = sorted(out.collect(), key=lambda r: r.id)
    assert [r.prediction for r in got] == logits.argmax(1).double().tolist()
    for r, row_logits in zip(got, logits):
        assert r.probability.toArray().tolist() == pytest.approx(
            torch.softmax(row_logits, 0).tolist()
        )
        assert r.rawPrediction.toArray().tolist() == pytest.approx(
            (row_logits - row_logits.mean()).tolist()
        )


def test_rows_of_non_finite_vector_features_get_no_class_in_transform(spark):
    """NaN, +inf and -inf in an ML vector give prediction NaN, not a class; the other rows
    keep theirs (docs/bad-input.md: the same for scalar and array columns, and in
    serving: tests/test_pyfunc.py)."""

    nan, inf = float("nan"), float("inf")
    x = [[2.0, 0.0], [nan, 1.0], [0.0, inf], [-inf, 0.0], [0.0, 3.0]]
    df = spark.createDataFrame([(Vectors.dense(v), i) for i, v in enumerate(x)], ["x", "id"])
    model = TorchModel(
        model=class_net(), feature_cols=["x"], classification=True, output_shapes=[[3]]
    )
    got = sorted(model.transform(df).collect(), key=lambda r: r.id)
    assert [r.prediction for r in got][::4] == [0.0, 1.0]
    assert all(math.isnan(r.prediction) for r in got[1:4])


@pytest.mark.parametrize("shape", [[], [1]])
def test_one_binary_logit_gives_two_class_columns(spark, shape):
    class Logit(torch.nn.Module):
        def forward(self, x):
            z = x.sum(1)
            return z if shape == [] else z.unsqueeze(1)

    df = spark.createDataFrame([([1.0, 0.5],), ([-2.0, 0.0],)], "x array<double>")
    model = TorchModel(
        model=Logit(),
        feature_cols=["x"],
        output_cols=["label_hat"],
        classification=True,
        probabilityCol="p",
        rawPredictionCol="raw",
        output_shapes=[shape],
    )
    got = {r.raw[1]: r for r in model.transform(df).collect()}
    assert set(got) == {1.5, -2.0}
    assert got[1.5].raw.toArray().tolist() == [-1.5, 1.5] and got[1.5].label_hat == 1.0
    p = torch.sigmoid(torch.tensor(-2.0, dtype=torch.float64)).item()
    assert got[-2.0].p.toArray().tolist() == pytest.approx([1 - p, p])
    assert got[-2.0].label_hat == 0.0


def test_spark_classification_evaluators_read_the_output(spark):
    import numpy as np
    from pyspark.ml.evaluation import (
        BinaryClassificationEvaluator,
        MulticlassClassificationEvaluator,
    )
    from sklearn.metrics import accuracy_score, f1_score, log_loss, roc_auc_score

    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 2))
    y = np.argmax(x @ np.array([[1.0, 0.0, -1.0], [0.0, 1.0, -1.0]]) + rng.normal(size=(200, 3)), 1)
    df = spark.createDataFrame(
        [(r.tolist(), int(c)) for r, c in zip(x, y)], "x array<double>, label long"
    )
    out = TorchModel(model=class_net(), feature_cols=["x"], classification=True).transform(df)
    logits = class_net()(torch.tensor(x, dtype=torch.float32)).detach().double()
    p = torch.softmax(logits, 1).numpy()
    for metric, expected in (
        ("accuracy", accuracy_score(y, p.argmax(1))),
        ("f1", f1_score(y, p.argmax(1), average="weighted")),
        ("logLoss", log_loss(y, p, labels=[0, 1, 2])),
    ):
        got = MulticlassClassificationEvaluator(metricName=metric).evaluate(out)
        assert got == pytest.approx(expected, rel=1e-4), metric

    # two logits a = 2 s, b = s: b alone ranks rows opposite to the log-odds b - a = -s
    two = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        two.weight.copy_(torch.tensor([[2.0, 2.0], [1.0, 1.0]]))
    binary = (x.sum(1) + rng.normal(size=200) < 0).astype(int)
    bdf = spark.createDataFrame(
        [(r.tolist(), int(c)) for r, c in zip(x, binary)], "x array<double>, label long"
    )
    scored = TorchModel(model=two, feature_cols=["x"], classification=True).transform(bdf)
    auc = BinaryClassificationEvaluator(metricName="areaUnderROC").evaluate(scored)
    assert auc == pytest.approx(roc_auc_score(binary, -x.sum(1)), abs=1e-6)
    assert auc > 0.7


@pytest.mark.parametrize(
    "params,message",
    [
        (dict(output_shapes=[[3], [3]]), "classification: the model has 2 outputs"),
        (dict(output_shapes=[[3, 4]]), r"classification: the model's output has shape \['B', 3"),
        (dict(output_shapes=[[0]]), r"classification: the model's output has shape \['B', 0\]"),
        (dict(output_cols=["a", "b"]), "classification: .* output_cols names 2"),
        (dict(probabilityCol="x"), "probabilityCol: column 'x' already exists"),
        (dict(rawPredictionCol="id"), "rawPredictionCol: column 'id' already exists"),
        (dict(output_cols=["x"]), "output_cols: column 'x' already exists"),
        (dict(rawPredictionCol="probability"), "classification: rawPredictionCol, probabilityCol"),
    ],
)
def test_classification_misuse_is_refused_on_the_driver(spark, params, message):
    df = spark.createDataFrame([([1.0, 2.0], 1)], "x array<double>, id long")
    model = TorchModel(model=class_net(), feature_cols=["x"], classification=True, **params)
    with pytest.raises(ValueError, match=message):
        model.transform(df)


@pytest.mark.parametrize(
    "params,message",
    [
        (dict(label_cols=["y", "z"]), r"classification: needs one label column .*\['y', 'z'\]"),
        (dict(output_cols=["p", "q"]), "classification: .* output_cols names 2"),
    ],
)
def test_estimator_classification_misuse_is_refused_before_any_job(spark, store, params, message):
    df = spark.createDataFrame([([1.0, 2.0, 3.0], 1, 0)], "x array<double>, y long, z long")
    est = make_estimator(store=store, classification=True, **params)
    spark.sparkContext.setJobGroup("bad-classification", "refused")
    try:
        with pytest.raises(ValueError, match=message):
            est.fit(df)
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
    assert list(spark.sparkContext.statusTracker().getJobIdsForGroup("bad-classification")) == []


def test_a_binary_classifier_fits_and_its_columns_survive_save_and_load(spark, store, tmp_path):
    from pyspark.ml.evaluation import BinaryClassificationEvaluator

    rows = [(x, float(x[0] - x[1] > 0.5)) for x, _, _ in regression_rows()]
    df = spark.createDataFrame(rows, "x array<double>, y double")
    est = make_estimator(
        store=store,
        loss=torch.nn.BCEWithLogitsLoss(),
        classification=True,
        probabilityCol="p",
        epochs=3,
        learning_rate=0.5,
    )
    model = est.fit(df)
    assert model.getClassification() and model.getProbabilityCol() == "p"
    out = model.transform(df)
    evaluator = BinaryClassificationEvaluator(labelCol="y", rawPredictionCol="rawPrediction")
    assert evaluator.evaluate(out) > 0.9
    path = str(tmp_path / "classifier")
    model.save(path)
    back = TorchModel.load(path)
    assert back.getClassification() and back.getProbabilityCol() == "p"
    assert back._feature_lengths == {"x": 3}  # the MLflow model's tensor signature's width
    assert (
        back.transform(df).select("p", "prediction").collect()
        == out.select("p", "prediction").collect()
    )
    est.save(str(tmp_path / "est"))
    loaded = TorchEstimator.load(str(tmp_path / "est"))
    assert loaded.getClassification() and loaded.getProbabilityCol() == "p"
    assert loaded.getLearningRate() == 0.5


def test_a_model_and_an_estimator_saved_before_decode_workers_load_and_decode(spark, tmp_path):
    """Stages saved before decode_pool, decode_batch_fn, decode_init_fn, fit_label_cols and
    feature_lengths existed (their metadata without them): loaded with those at their
    defaults."""
    from spark_estimator.driver.persistence import METADATA_DIR

    new = {"decode_pool", "decode_batch_fn", "decode_init_fn", "fit_label_cols", "feature_lengths"}

    def as_saved_before(path) -> None:
        (part,) = (path / METADATA_DIR).glob("part-*")
        metadata = json.loads(part.read_text())
        for key in ("paramMap", "defaultParamMap"):
            metadata[key] = {k: v for k, v in metadata[key].items() if k not in new}
        for key in new:
            metadata.pop(key, None)
        part.write_text(json.dumps(metadata) + "\n")

    def lengths(row, augment):  # a string's characters as one float each (a sequence)
        return {"text": torch.tensor([float(len(row["text"]))])}

    class Net(torch.nn.Linear):
        def forward(self, values, mask):  # a padded sequence: its values, then its mask
            return super().forward(values)

    net = Net(1, 1)
    TorchModel(model=net, feature_cols=["text"], decode_fn=lengths).save(str(tmp_path / "m"))
    make_estimator(decode_fn=lengths).save(str(tmp_path / "e"))
    for name in ("m", "e"):
        as_saved_before(tmp_path / name)
    model = TorchModel.load(str(tmp_path / "m"))
    estimator = TorchEstimator.load(str(tmp_path / "e"))
    for stage in (model, estimator):
        assert stage.getDecodePool() == "auto" and stage.getDecodeBatchFn() is None
        assert stage.getDecodeFn()({"text": "abc"}, None)["text"].tolist() == [3.0]
    df = spark.createDataFrame([("ab",), ("abcd",)], "text string")
    out = [r.prediction[0] for r in model.transform(df).orderBy("text").collect()]
    with torch.no_grad():
        assert out == pytest.approx([net(torch.tensor([[n]]), None).item() for n in (2.0, 4.0)])
