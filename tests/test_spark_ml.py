"""Our stages inside Spark ML: Pipelines, tuning (CrossValidator, TrainValidationSplit),
copy semantics, fitMultiple and the learning_rate param, on a real local[4] session."""

import copy
import math

import pytest
import torch
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import MulticlassClassificationEvaluator, RegressionEvaluator
from pyspark.ml.feature import StringIndexer, VectorAssembler
from pyspark.ml.tuning import (
    CrossValidator,
    CrossValidatorModel,
    ParamGridBuilder,
    TrainValidationSplit,
)

from spark_estimator import TorchEstimator, TorchModel
from tests.conftest import digits_rows, linear_net, make_estimator, regression_rows


@pytest.fixture
def scalar_df(spark):
    """The regression rows with the three features as scalar columns a, b, c."""
    rows = [(*x, y) for x, y, _ in regression_rows(120)]
    return spark.createDataFrame(rows, "a double, b double, c double, y double")


def predictions(df, col="prediction"):
    return [r[col] for r in df.orderBy("a").collect()]


def test_pipeline_fits_transforms_and_reloads_with_the_torch_model(
    spark, scalar_df, store, tmp_path
):
    assembler = VectorAssembler(inputCols=["a", "b", "c"], outputCol="features")
    est = make_estimator(store=store, feature_cols=["features"], epochs=2)
    fitted = Pipeline(stages=[assembler, est]).fit(scalar_df)
    torch_model = fitted.stages[1]
    assert isinstance(torch_model, TorchModel) and len(torch_model.getHistory()) == 2
    out = fitted.transform(scalar_df)
    assert out.columns == ["a", "b", "c", "y", "features", "prediction"]
    rmse = RegressionEvaluator(labelCol="y", metricName="rmse").evaluate(out)
    assert rmse < 1.0  # y = x . w + 0.5 has an std of about 2.6; a linear net learns it

    path = str(tmp_path / "pipeline_model")
    fitted.save(path)
    loaded = PipelineModel.load(path)
    back = loaded.stages[1]
    assert isinstance(back, TorchModel) and back.uid == torch_model.uid
    assert back.getHistory() == torch_model.getHistory()
    assert predictions(loaded.transform(scalar_df)) == predictions(out)

    Pipeline(stages=[assembler, est]).save(str(tmp_path / "pipeline"))
    unfitted = Pipeline.load(str(tmp_path / "pipeline")).getStages()[1]
    assert isinstance(unfitted, TorchEstimator) and unfitted.getEpochs() == 2
    assert unfitted.getFeatureCols() == ["features"]


def test_cross_validator_picks_the_better_learning_rate_in_threads_and_reloads(
    spark, regression_df, store, tmp_path
):
    est = make_estimator(store=store, epochs=1)
    grid = (
        ParamGridBuilder()
        .addGrid(est.learning_rate, [1e-4, 0.1])
        .addGrid(est.epochs, [1, 2])
        .build()
    )
    cv = CrossValidator(
        estimator=est,
        estimatorParamMaps=grid,
        evaluator=RegressionEvaluator(labelCol="y"),
        numFolds=2,
        parallelism=2,
        seed=1,
    )
    fitted = cv.fit(regression_df)
    rmse = {(m[est.learning_rate], m[est.epochs]): v for m, v in zip(grid, fitted.avgMetrics)}
    assert rmse[(0.1, 2)] < rmse[(0.1, 1)] < rmse[(1e-4, 1)]
    assert rmse[(0.1, 2)] < rmse[(1e-4, 2)]
    best = fitted.bestModel
    assert best.getTrainingSummary()["base_learning_rates"] == [pytest.approx(0.1)]
    assert len(best.getHistory()) == 2

    path = str(tmp_path / "cv_model")
    fitted.save(path)
    loaded = CrossValidatorModel.load(path)
    assert loaded.avgMetrics == pytest.approx(fitted.avgMetrics)
    assert loaded.bestModel.getHistory() == best.getHistory()
    expected = [r.prediction for r in best.transform(regression_df).orderBy("id").collect()]
    got = [r.prediction for r in loaded.transform(regression_df).orderBy("id").collect()]
    assert got == expected


def test_train_validation_split_tunes_a_classifier_with_an_accuracy_evaluator(spark, store):
    df = spark.createDataFrame(digits_rows(400), ["features", "label"])
    net = linear_net(64, 10)
    est = TorchEstimator(
        model=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
        loss=torch.nn.CrossEntropyLoss(),
        feature_cols=["features"],
        label_cols=["label"],
        classification=True,
        batch_size=32,
        num_proc=2,
        store=store,
        use_gpu=False,
    )
    grid = (
        ParamGridBuilder()
        .addGrid(est.learning_rate, [1e-4, 0.5])
        .addGrid(est.epochs, [1, 3])
        .build()
    )
    tvs = TrainValidationSplit(
        estimator=est,
        estimatorParamMaps=grid,
        evaluator=MulticlassClassificationEvaluator(metricName="accuracy"),
        trainRatio=0.75,
        parallelism=2,
        seed=3,
    )
    fitted = tvs.fit(df)
    acc = {(m[est.learning_rate], m[est.epochs]): v for m, v in zip(grid, fitted.validationMetrics)}
    assert acc[(0.5, 3)] > 0.8 and acc[(0.5, 3)] > acc[(0.5, 1)] > acc[(1e-4, 3)] + 0.2
    best = fitted.bestModel
    assert best.getClassification() and len(best.getHistory()) == 3
    assert best.getTrainingSummary()["base_learning_rates"] == [0.5]


def iris_df(spark):
    from sklearn.datasets import load_iris

    iris = load_iris()
    rows = [(*map(float, x), str(iris.target_names[t])) for x, t in zip(iris.data, iris.target)]
    return spark.createDataFrame(rows, "a double, b double, c double, d double, species string")


def test_string_indexer_labels_train_a_cross_entropy_classifier_in_a_pipeline(spark, store):
    """StringIndexer's labels are doubles of whole numbers: with classification=True (or a
    class-index loss) they reach CrossEntropyLoss as int64 class indices."""
    df = iris_df(spark)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    est = TorchEstimator(
        model=net,
        optimizer=torch.optim.Adam(net.parameters(), lr=0.05),
        loss=torch.nn.CrossEntropyLoss(),
        feature_cols="features",
        label_cols="label",
        classification=True,
        batch_size=16,
        epochs=25,
        num_proc=1,
        store=store,
        use_gpu=False,
    )
    indexer = StringIndexer(inputCol="species", outputCol="label")
    assembler = VectorAssembler(inputCols=["a", "b", "c", "d"], outputCol="features")
    fitted = Pipeline(stages=[indexer, assembler, est]).fit(df)
    out = fitted.transform(df)
    assert dict(out.dtypes)["label"] == "double"  # the labels as StringIndexer made them
    accuracy = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(out)
    assert accuracy > 0.9


def test_estimator_copy_takes_extra_params_and_leaves_the_original(store):
    est = make_estimator(store=store, epochs=3)
    copied = est.copy({est.epochs: 5, est.learning_rate: 0.2, est.classification: True})
    assert copied.uid == est.uid and copied is not est
    assert (copied.getEpochs(), copied.getLearningRate(), copied.getClassification()) == (
        5,
        0.2,
        True,
    )
    assert (est.getEpochs(), est.getLearningRate(), est.getClassification()) == (3, None, False)
    copied.setBatchSize(4)
    assert est.getBatchSize() == 16
    assert copied.getParam("epochs").parent == est.uid


def test_model_copy_has_its_own_module_history_and_summary(regression_df, store):
    model = make_estimator(store=store, epochs=1).fit(regression_df)
    copied = model.copy({model.output_cols: ["score"]})
    assert copied.uid == model.uid
    assert copied.getOutputCols() == ["score"] and model.getOutputCols() is None
    copied.getHistory()[0]["train"]["loss"] = -1.0
    copied.getTrainingSummary()["learning_rates"].append(9.0)
    with torch.no_grad():
        copied.getModel().weight.zero_()
    assert model.getHistory()[0]["train"]["loss"] >= 0
    assert model.getTrainingSummary()["learning_rates"] == [0.1]
    assert model.getModel().weight.abs().sum() > 0
    scores = [r.score for r in copied.transform(regression_df).collect()]
    bias = copied.getModel().bias.item()
    assert scores == pytest.approx([bias] * regression_df.count())
    with_params = model.transform(regression_df, {model.output_cols: ["other"]})
    assert "other" in with_params.columns and model.getOutputCols() is None


def test_fit_leaves_the_users_model_and_optimizer_unchanged(regression_df, store):
    net = linear_net()
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.ones(2, 3)).sum().backward()
    opt.step()  # the optimizer has state (momentum buffers) before the fit
    weights, state = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
    est = make_estimator(
        net,
        store,
        optimizer=opt,
        epochs=2,
        learning_rate=0.05,
        lr_scaling="linear",
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5),
    )
    model = est.fit(regression_df)
    assert all(torch.equal(net.state_dict()[k], v) for k, v in weights.items())
    after = opt.state_dict()
    assert after["param_groups"] == state["param_groups"]
    assert all(
        torch.equal(after["state"][i]["momentum_buffer"], s["momentum_buffer"])
        for i, s in state["state"].items()
    )
    assert net.training and "initial_lr" not in opt.param_groups[0]
    assert model.getModel() is not net
    summary = model.getTrainingSummary()
    assert summary["base_learning_rates"] == [0.05]  # learning_rate, before lr_scaling
    assert [h["lr"][0] for h in model.getHistory()] == pytest.approx([0.1, 0.05])


def test_fit_multiple_fits_each_param_map(regression_df, store):
    est = make_estimator(store=store, epochs=1)
    maps = [{est.epochs: 1}, {est.epochs: 2, est.learning_rate: 0.05}]
    models = dict(est.fitMultiple(regression_df, maps))
    assert sorted(models) == [0, 1]
    assert len(models[0].getHistory()) == 1 and len(models[1].getHistory()) == 2
    assert models[0].getTrainingSummary()["base_learning_rates"] == [0.1]
    assert models[1].getTrainingSummary()["base_learning_rates"] == [0.05]
    assert est.getEpochs() == 1 and est.getLearningRate() is None


@pytest.mark.parametrize("bad", [0.0, -0.1, math.nan, math.inf])
def test_a_bad_learning_rate_is_refused_on_the_driver(spark, regression_df, store, bad):
    spark.sparkContext.setJobGroup("bad-lr", "refused learning rates")
    try:
        with pytest.raises(ValueError, match="learning_rate: must be a finite number > 0"):
            make_estimator(store=store, learning_rate=bad).fit(regression_df)
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
    assert list(spark.sparkContext.statusTracker().getJobIdsForGroup("bad-lr")) == []


def test_a_learning_rate_that_is_not_a_number_is_refused_when_set():
    with pytest.raises(TypeError, match="learning_rate"):
        make_estimator(learning_rate="fast")


def test_a_run_resumed_with_another_learning_rate_goes_on_at_the_new_one(regression_df, store):
    """learning_rate, as a grid search tunes it: a run resumed (or trained further) with
    another rate trains its next epochs at that rate, and its history says so."""
    make_estimator(store=store, run_id="r", epochs=1, learning_rate=0.05).fit(regression_df)
    store.remove(store.run("r").result)  # as if the driver died after epoch 1
    model = make_estimator(store=store, run_id="r", epochs=2, learning_rate=0.1).fit(regression_df)
    assert [h["lr"] for h in model.getHistory()] == [[0.05], [0.1]]
    assert model.getTrainingSummary()["resumed_from_epoch"] == 1
