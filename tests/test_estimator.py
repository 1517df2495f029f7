"""TorchEstimator.fit end to end on a real local[4] Spark session."""

import math
import re
import threading
import uuid
from pathlib import Path

import pytest
import torch
from pyspark.sql import functions as F

import spark_estimator.driver.training_job as training_job
from spark_estimator import Store, TorchEstimator, TorchModel
from spark_estimator.callbacks import BestModel
from spark_estimator.driver import loss_probe, run_manifest, validate, validate_training
from spark_estimator.shared.packages import require_petastorm
from spark_estimator.shared.serialization import state_from_bytes
from tests.conftest import LOCAL, cnn, digits_rows, linear_net, make_estimator, spark_session


def ranks(store, model):
    return store.read_json(store.run(model.getRunId()).ranks)


@pytest.fixture(scope="module")
def digits_fit(tmp_path_factory):
    spark = spark_session(LOCAL)
    store = Store.create(str(tmp_path_factory.mktemp("digits") / "store"))
    train, test = spark.createDataFrame(digits_rows(), ["features", "label"]).randomSplit(
        [0.8, 0.2], seed=7
    )
    net = cnn()
    est = TorchEstimator(
        model=net,
        optimizer=torch.optim.Adam(net.parameters(), lr=3e-3),
        loss=torch.nn.CrossEntropyLoss(),
        feature_cols=["features"],
        label_cols=["label"],
        input_shapes=[[1, 8, 8]],  # one row's shape, as Horovod's users write it
        batch_size=32,
        epochs=6,
        num_proc=2,
        validation=0.2,
        random_seed=42,
        store=store,
        run_id="digits-run",
    )
    return est, est.fit(train), train, test, store


def test_digits_reach_high_held_out_accuracy(digits_fit):
    _, model, _, test, _ = digits_fit
    predicted = F.expr("array_position(prediction, array_max(prediction)) - 1")
    out = model.transform(test)
    accuracy = out.select(F.avg((predicted == F.col("label")).cast("double"))).first()[0]
    assert accuracy >= 0.9


def test_history_has_one_record_per_epoch_with_train_and_validation_loss(digits_fit):
    _, model, _, _, _ = digits_fit
    history = model.getHistory()
    assert [h["epoch"] for h in history] == [1, 2, 3, 4, 5, 6]
    keys = {"epoch", "num_proc", "lr", "train", "validation", "seconds"}
    assert all(set(h) == keys for h in history)
    assert all(h["num_proc"] == 2 for h in history)
    assert history[-1]["train"]["loss"] < history[0]["train"]["loss"] / 2
    assert history[-1]["validation"]["loss"] < history[0]["validation"]["loss"] / 2


def test_rank_zero_checkpoints_every_epoch_under_the_run_id(digits_fit):
    _, model, _, _, store = digits_fit
    assert model.getRunId() == "digits-run"
    for epoch in range(1, 7):
        checkpoint = state_from_bytes(store.read_bytes(store.run("digits-run").checkpoint(epoch)))
        assert checkpoint["epoch"] == epoch and len(checkpoint["history"]) == epoch
        assert set(checkpoint["optimizer"]) == {"state", "param_groups"}
    final = state_from_bytes(store.read_bytes(store.run("digits-run").checkpoint(6)))["model"]
    trained = model.getModel().state_dict()
    assert all(torch.equal(final[k], trained[k]) for k in trained)


def test_ranks_split_the_rows_and_end_with_identical_weights(digits_fit):
    est, model, train, _, store = digits_fit
    summary = ranks(store, model)
    assert [s["rank"] for s in summary] == [0, 1]
    assert len({s["weights_digest"] for s in summary}) == 1
    train_rows = sum(s["train_rows"] for s in summary)
    val_rows = sum(s["validation_rows"] for s in summary)
    assert train_rows + val_rows == train.count()
    per_rank = math.ceil(train_rows / 2)
    assert all(s["batches_per_epoch"] == [math.ceil(per_rank / 32)] * 6 for s in summary)


def test_returned_model_is_a_cpu_module_and_fit_left_the_users_model_alone(digits_fit):
    est, model, _, _, _ = digits_fit
    assert isinstance(model, TorchModel)
    trained = model.getModel()
    assert all(p.device.type == "cpu" for p in trained.parameters())
    assert trained is not est.getModel()
    untouched = cnn().state_dict()
    assert all(torch.equal(untouched[k], v) for k, v in est.getModel().state_dict().items())


def test_refit_reuses_the_materialized_data(digits_fit):
    est, model, train, _, store = digits_fit
    meta = store.fs.glob(store.dataset("*").meta)
    assert len(meta) == 1
    before = store.fs.modified(meta[0])
    again = est.copy({est.epochs: 1, est.run_id: "digits-again"}).fit(train)
    assert store.fs.glob(store.dataset("*").meta) == meta
    assert store.fs.modified(meta[0]) == before
    assert len(again.getHistory()) == 1
    # the fits' own account of their time: the steps add up to the total
    first, second = model.getTrainingSummary(), again.getTrainingSummary()
    assert (first["dataset_reused"], second["dataset_reused"]) == (False, True)
    steps = ["validation", "dataset", "launch", "training", "result"]
    for fitted in model, again:
        seconds = fitted.getTrainingSummary()["fit_seconds"]
        assert set(seconds) == {*steps, "total"} and min(seconds.values()) >= 0
        assert sum(seconds[s] for s in steps) == pytest.approx(seconds["total"], abs=0.01)
        assert seconds["training"] == max(r["seconds"] for r in ranks(store, fitted))
    assert second["fit_seconds"]["dataset"] < first["fit_seconds"]["dataset"]


def test_a_fit_runs_each_driver_check_once(regression_df, store, spy):
    checks = {
        validate: ["check_columns", "check_column_names", "check_num_proc"],
        validate_training: ["check_loop", "check_metrics", "check_callbacks"],
        run_manifest: ["check_resume", "check_resume_data"],
    }
    once = {name: 1 for names in checks.values() for name in names}

    def counted(fit, run_id: str) -> tuple[dict[str, int], list]:
        calls = {name: spy(module, name) for module, names in checks.items() for name in names}
        probes = spy(loss_probe, "check_loss")
        fit(
            make_estimator(
                store=store,
                epochs=1,
                validation=0.25,
                metrics={"mae": torch.nn.functional.l1_loss},
                callbacks=[BestModel("validation.mae")],
                run_id=run_id,
            )
        )
        return {name: len(results) for name, results in calls.items()}, probes

    calls, probes = counted(lambda est: est.fit(regression_df), "checked-once")
    assert calls == once  # check_column_names by check_columns
    assert probes == [False, True]  # x is an array: probed once its length is known
    path = make_estimator(store=store, validation=0.25).materialize(regression_df)
    calls, probes = counted(lambda est: est.fit_on_parquet(path), "checked-once-on-parquet")
    assert calls == {**once, "check_columns": 0}  # the Parquet's columns, by parquet_dataset
    assert probes == [True]  # the lengths are known from the dataset


def test_regression_with_a_loss_function_and_scalar_prediction(regression_df, store):
    net = linear_net()
    est = make_estimator(
        net, store, loss=lambda out, y: ((out - y) ** 2).mean(), epochs=15, output_cols=["y_hat"]
    )
    model = est.fit(regression_df)
    assert model.getHistory()[-1]["train"]["loss"] < 1e-3
    out = model.transform(regression_df)
    assert out.columns == ["x", "y", "id", "y_hat"]
    assert dict(out.dtypes)["y_hat"] == "double"
    worst = out.select(F.max(F.abs(F.col("y") - F.col("y_hat")))).first()[0]
    assert worst < 0.1


def test_a_loss_given_by_name_trains_as_its_torch_module(regression_df, store):
    """loss='mse' is torch.nn.MSELoss(): the same weights as the module, in a real fit; a
    name that is none is refused when set, naming the close one and the names taken."""
    est = make_estimator(linear_net(), store, loss="mse", epochs=2, num_proc=1)
    assert isinstance(est.getLoss(), torch.nn.MSELoss)
    by_name = est.fit(regression_df).getModel().weight.detach()
    module = make_estimator(linear_net(), store, loss=torch.nn.MSELoss(), epochs=2, num_proc=1)
    assert torch.equal(by_name, module.fit(regression_df).getModel().weight.detach())
    with pytest.raises(ValueError) as refused:
        est.setLoss("msee")
    assert str(refused.value).startswith(
        "loss: 'msee' is not a loss name (did you mean loss='mse'?); loss takes a loss "
        "module (loss=torch.nn.MSELoss()), a function (output, label) -> scalar tensor, or "
        "one of the names 'mse' / 'l2' (MSELoss), 'mae' / 'l1' (L1Loss), 'cross_entropy' "
        "(CrossEntropyLoss)"
    )
    assert isinstance(est.getLoss(), torch.nn.MSELoss)  # left as it was


def test_a_finished_run_id_without_more_epochs_is_refused_and_warm_starting_works(
    regression_df, store, tmp_path
):
    first = make_estimator(linear_net(), store, run_id="first", epochs=2).fit(regression_df)
    with pytest.raises(ValueError, match="run_id: run 'first' already finished 2 epochs") as e:
        make_estimator(linear_net(), store, run_id="first", epochs=2).fit(regression_df)
    assert "epochs > 2" in str(e.value) and "a new run_id" in str(e.value)
    first.save(str(tmp_path / "first"))
    warm = linear_net()
    warm.load_state_dict(TorchModel.load(str(tmp_path / "first")).getModel().state_dict())
    resumed = make_estimator(warm, store, run_id="warm", epochs=1).fit(regression_df)
    assert resumed.getHistory()[0]["train"]["loss"] < first.getHistory()[1]["train"]["loss"]


def test_same_seed_same_weights_other_seed_other_weights(regression_df, store):
    def weights(seed):
        model = make_estimator(linear_net(), store, random_seed=seed, validation=0.2).fit(
            regression_df
        )
        return model.getModel().weight.detach().clone()

    first, again, other = weights(1), weights(1), weights(2)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_default_num_proc_uses_every_slot_and_uneven_shards_do_not_hang(spark, store):
    # 7 rows on 4 ranks with batch_size 1: shards of 2, 2, 2, 1, so the last rank has an
    # empty batch in step 2 and must still join the allreduce.
    df = spark.createDataFrame(
        [([float(i)], float(i)) for i in range(7)], "x array<float>, y float"
    )
    model = make_estimator(linear_net(1), store, num_proc=None, batch_size=1, epochs=2).fit(df)
    summary = ranks(store, model)
    assert [s["train_rows"] for s in summary] == [2, 2, 2, 1]
    assert [s["batches_per_epoch"] for s in summary] == [[2, 2]] * 4


def test_boolean_validation_column(regression_df, store):
    df = regression_df.withColumn("is_val", F.col("id") < 40)
    model = make_estimator(linear_net(), store, validation="is_val").fit(df)
    assert sum(s["validation_rows"] for s in ranks(store, model)) == 40
    assert "validation" in model.getHistory()[0]


def test_two_label_columns_with_two_model_outputs(spark, store):
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 3)

        def forward(self, x):
            return self.a(x), self.b(x)

    rows = [([float(i % 5), 1.0], float(i % 5), i % 3) for i in range(60)]
    df = spark.createDataFrame(rows, "x array<float>, y float, c int")

    def loss(out, label):
        if label.dtype == torch.int64:
            return torch.nn.functional.cross_entropy(out, label)
        return torch.nn.functional.mse_loss(out, label)

    torch.manual_seed(0)
    net = TwoHeads()
    model = make_estimator(net, store, label_cols=["y", "c"], loss=loss).fit(df)
    assert model.getOutputShapes() == [[1], [3]]
    out = model.transform(df)
    assert dict(out.dtypes)["prediction_0"] == "double"
    assert dict(out.dtypes)["prediction_1"] == "array<float>"


def test_a_one_hot_vector_label_column_trains_and_the_model_transforms(spark, store):
    from pyspark.ml.feature import OneHotEncoder

    digits = spark.createDataFrame(digits_rows(400), ["features", "label"])
    encoder = OneHotEncoder(inputCols=["label"], outputCols=["one_hot"], dropLast=False)
    df = encoder.fit(digits).transform(digits)  # one_hot: a 10-wide sparse ML Vector
    net = torch.nn.Sequential(torch.nn.Linear(64, 10))
    est = TorchEstimator(
        model=net,
        optimizer=torch.optim.Adam(net.parameters(), lr=0.05),
        loss=torch.nn.CrossEntropyLoss(),  # class probabilities as the target
        feature_cols=["features"],
        label_cols=["one_hot"],
        batch_size=32,
        epochs=4,
        num_proc=2,
        store=store,
        use_gpu=False,
    )
    model = est.fit(df)
    history = model.getHistory()
    assert history[-1]["train"]["loss"] < history[0]["train"]["loss"] / 2
    out = model.transform(df).select("label", "prediction").toPandas()
    predicted = [max(range(10), key=row.__getitem__) for row in out["prediction"]]
    assert sum(p == y for p, y in zip(predicted, out["label"])) / len(out) >= 0.9


def mean_loss(output, label):
    return ((output.view(-1) - label) ** 2).mean()


# the loss on a probe batch (driver/loss_probe.py): with array features and no input_shapes
# it runs once the materialized dataset records the arrays' length, before the training job
@pytest.mark.parametrize(
    "params,message",
    [
        (dict(label_cols=["y", "id"]), "label_cols: the model returned 1 outputs for 2 label"),
        (
            dict(loss=mean_loss, sample_weight_col="w"),
            r"sample_weight_col: the loss for label column 'y' returned shape \(\)",
        ),
    ],
)
def test_a_loss_that_cannot_work_is_refused_before_the_training_job(
    regression_df, store, monkeypatch, params, message
):
    launched = []
    monkeypatch.setattr(training_job, "run_barrier_job", lambda *a, **k: launched.append(a))
    est = make_estimator(params.pop("net", linear_net()), store, num_proc=1, **params)
    with pytest.raises(ValueError, match=message):
        est.fit(regression_df.withColumn("w", F.lit(2.0)))
    assert launched == []


def test_a_model_that_does_not_fit_assembled_features_is_refused_before_any_job(spark, store):
    """A Pipeline's vector column records its length (VectorAssembler's ML attributes), so
    ``Linear(5, 16)`` on 4 assembled features is refused before any Spark job."""
    from pyspark.ml.feature import VectorAssembler

    rows = [(float(i), 1.0, 2.0, 3.0, i % 3) for i in range(12)]
    df = spark.createDataFrame(rows, "a double, b double, c double, d double, label long")
    assembled = VectorAssembler(inputCols=list("abcd"), outputCol="features").transform(df)
    net = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    est = make_estimator(
        net,
        store,
        num_proc=1,
        feature_cols=["features"],
        label_cols=["label"],
        loss=torch.nn.CrossEntropyLoss(),
    )
    group = f"layer-{uuid.uuid4().hex}"
    spark.sparkContext.setJobGroup(group, "a model that does not fit")
    try:
        with pytest.raises(ValueError) as e:
            est.fit(assembled)
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
    assert list(spark.sparkContext.statusTracker().getJobIdsForGroup(group)) == []
    assert str(e.value) == (
        "model: layer '0' (Linear(in_features=5, out_features=16, bias=True)) does not fit the "
        "feature columns 'features' [B, 4] (no input_shapes): RuntimeError: mat1 and mat2 "
        "shapes cannot be multiplied (2x4 and 5x16); tried on the driver on 2 rows; make the "
        "layer fit the columns, or the columns the layer (input_shapes reshapes a column's rows)"
    )
    assert not store.exists(store.runs)  # no run started


# errors only the executors can see (docs/bad-input.md, second list); the exception type the
# driver raises for a failed training job may change, so only the message is matched
def test_a_loss_not_per_row_is_reported_from_the_first_batch_where_not_probed(store):
    """Arrays of the user's Parquet have no recorded length: the probe cannot run."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    x = pa.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], pa.list_(pa.float64()))
    table = pa.table({"x": x, "y": [0.0, 1.0], "w": [1.0, 2.0]})
    store.fs.makedirs(store.join("unprobed"), exist_ok=True)
    pq.write_table(table, store.join("unprobed", "part-0.parquet"))
    est = make_estimator(linear_net(), store, num_proc=1, loss=mean_loss, sample_weight_col="w")
    with pytest.raises(
        Exception, match=r"sample_weight_col: the loss for label column 'y' returned shape \(\)"
    ):
        est.fit_on_parquet("unprobed")


def test_a_transformation_fn_dropping_a_column_is_reported_from_the_first_batch(
    regression_df, store
):
    est = make_estimator(
        linear_net(), store, num_proc=1, transformation_fn=lambda batch: {"x": batch["x"]}
    )
    with pytest.raises(
        Exception, match="transformation_fn: the returned dict has no tensor for column 'y'"
    ):
        est.fit(regression_df)


@pytest.mark.parametrize(
    "x,params,message",
    [
        ([[1.0, 2.0], None], {}, "column 'x': 1 null values"),
        ([[1.0, 2.0], [1.0, None]], {}, "column 'x': arrays contain null elements"),
        ([[1.0, 2.0], [1.0]], {}, "column 'x': arrays have varying lengths (1 to 2)"),
        (
            [[1.0, 2.0], [3.0, 4.0]],
            {"input_shapes": [[-1, 3]]},
            "input_shapes: shape [-1, 3] has 3 elements per row, but column 'x' has rows of "
            "length 2",
        ),
    ],
)
def test_array_columns_of_users_parquet_are_checked_on_the_executors(store, x, params, message):
    """fit_on_parquet reads only footers on the driver: these show in the first batch."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"x": pa.array(x, pa.list_(pa.float64())), "y": [0.0, 1.0]})
    store.fs.makedirs(store.join("mine"), exist_ok=True)
    pq.write_table(table, store.join("mine", "part-0.parquet"))
    est = make_estimator(linear_net(2), store, num_proc=1, epochs=1, **params)
    with pytest.raises(Exception, match=re.escape(message)):
        est.fit_on_parquet("mine")


# -- bad input: a clear error naming the parameter or column, before the training job ------
BAD_SCHEMA = (
    "x array<float>, y float, id long, name string, v boolean, m map<string,double>, "
    "s struct<a:double>"
)


def _row(i: int, x=(1.0, 2.0, 3.0), y=1.0, v=False) -> tuple:
    return (None if x is None else list(x), y, i, "a", v, {"k": 1.0}, (1.0,))


GOOD_ROWS = [_row(0), _row(1)]


def _data_cases() -> dict:
    """Bad data found by the materialization's one Spark write, before the training job:
    case -> (params, error, message, rows of BAD_SCHEMA or None for GOOD_ROWS)."""
    nan, inf = float("nan"), float("inf")
    return {
        "null feature": (
            {},
            ValueError,
            "feature_cols: column 'x' has 1 null values",
            [_row(0), _row(1, x=None)],
        ),
        "null label": (
            {},
            ValueError,
            "label_cols: column 'y' has 1 null values",
            [_row(0), _row(1, y=None)],
        ),
        "null element in an array": (
            {},
            ValueError,
            "feature_cols: column 'x' has 1 null values",
            [_row(0), _row(1, x=(1.0, None, 3.0))],
        ),
        "NaN feature": (
            {},
            ValueError,
            "feature_cols: column 'x' has 1 NaN or infinite values",
            [_row(0), _row(1, x=(1.0, nan, 3.0))],
        ),
        "inf feature": (
            {},
            ValueError,
            "feature_cols: column 'x' has 2 NaN or infinite values",
            [_row(0), _row(1, x=(inf, -inf, 3.0))],
        ),
        "ragged arrays with input_shapes": (
            dict(input_shapes=[[3]]),
            ValueError,
            "input_shapes: column 'x' has arrays of varying length, padded per batch",
            [_row(0), _row(1, x=(1.0, 2.0))],
        ),
        # an array column's length from input_shapes alone may be the mistake: the layer is
        # judged once the data's lengths are known (after the write, before training)
        "model layer that does not fit the columns": (
            dict(net=linear_net(5, 1), input_shapes=[[3]]),
            ValueError,
            "model: Linear(in_features=5, out_features=1, bias=True) does not fit the feature "
            "columns 'x' [B, 3] (input_shapes=[[3]]): RuntimeError: mat1 and mat2 shapes",
            None,
        ),
        "input_shapes element count": (
            dict(input_shapes=[[-1, 2, 2]]),
            ValueError,
            "input_shapes: shape [-1, 2, 2] has 4 elements per row, but column 'x' has rows "
            "of length 3",
            None,
        ),
        "class labels not whole numbers": (
            dict(loss=torch.nn.CrossEntropyLoss(), net=linear_net(3, 2)),
            ValueError,
            "label_cols: column 'y' has 1 values that are not whole numbers",
            [_row(0, y=1.0), _row(1, y=0.5)],
        ),
        "class scores fewer than the classes": (
            dict(loss=torch.nn.CrossEntropyLoss(), net=linear_net(3, 2)),
            ValueError,
            "label column 'y' holds class indices up to 2, so the model must return [B, 3]",
            [_row(0, y=0.0), _row(1, y=2.0)],
        ),
        "empty DataFrame": ({}, ValueError, "DataFrame: no training rows", []),
        "empty validation split": (
            dict(validation="v"),
            ValueError,
            "validation: the split 'v' selected no validation rows",
            None,
        ),
    }


def _bad_inputs():
    net = linear_net()
    other = linear_net()

    class Unpicklable(torch.nn.Linear):
        def __init__(self):
            super().__init__(3, 1)
            self.lock = threading.Lock()

    class UnpicklableLoss(torch.nn.MSELoss):
        def __init__(self):
            super().__init__()
            self.lock = threading.Lock()

    class NeedsRate(torch.optim.SGD):
        def __init__(self, params, lr):
            super().__init__(params, lr=lr)

    bad_net = Unpicklable()
    return {
        "optimizer class without a default lr": (
            dict(optimizer=NeedsRate),
            ValueError,
            "optimizer: NeedsRate has no default lr; set learning_rate",
        ),
        "missing feature column": (
            dict(feature_cols=["nope"]),
            ValueError,
            "feature_cols: column 'nope'",
        ),
        "missing label column": (
            dict(label_cols=["nope"]),
            ValueError,
            "label_cols: column 'nope'",
        ),
        "string feature without decode_fn": (
            dict(feature_cols=["name"]),
            ValueError,
            "decode_fn: feature column 'name' holds strings, which would reach forward() as a "
            "list of Python strings. Categories: index them first with pyspark.ml.feature."
            "StringIndexer(inputCol='name', outputCol='name_index'), then OneHotEncoder(",
        ),
        "string label without decode_fn": (
            dict(label_cols=["name"]),
            ValueError,
            "label_cols: column 'name' holds strings, which the loss cannot take",
        ),
        "decode_fn and decode_batch_fn": (
            dict(
                feature_cols=["name"],
                decode_fn=lambda row, augment: row,
                decode_batch_fn=lambda rows, augments: rows,
            ),
            ValueError,
            "decode_batch_fn: is the batch form of decode_fn; give one of them, not both",
        ),
        "unknown decode_pool": (
            dict(decode_pool="forks"),
            ValueError,
            "decode_pool: must be one of",
        ),
        "decode_timeout not positive": (
            dict(decode_timeout=0.0),
            ValueError,
            "decode_timeout: must be > 0",
        ),
        "map column": (
            dict(feature_cols=["m"]),
            TypeError,
            "feature_cols: column 'm' has type map<string,double>",
        ),
        "struct column": (
            dict(feature_cols=["s"]),
            TypeError,
            "feature_cols: column 's' has type struct<a:double>",
        ),
        "num_proc < 1": (dict(num_proc=0), ValueError, "num_proc: must be >= 1"),
        "num_proc > slots": (dict(num_proc=5), ValueError, "num_proc: 5 training processes"),
        "min_num_proc > num_proc": (
            dict(num_proc=2, min_num_proc=3),
            ValueError,
            "min_num_proc: 3 is more than num_proc=2",
        ),
        "min_num_proc > slots": (
            dict(num_proc=8, min_num_proc=5),
            ValueError,
            "min_num_proc: 5 training processes requested but the cluster can run only 4",
        ),
        "min_num_proc < 1": (dict(min_num_proc=0), ValueError, "min_num_proc: must be >= 1"),
        "max_restarts < 0": (dict(max_restarts=-1), ValueError, "max_restarts: must be >= 0"),
        "commit_every_steps < 0": (
            dict(commit_every_steps=-2),
            ValueError,
            "commit_every_steps: must be >= 0",
        ),
        "log_every_steps < 0": (
            dict(log_every_steps=-1),
            ValueError,
            "log_every_steps: must be >= 0",
        ),
        "elastic_timeout <= 0": (
            dict(elastic_timeout=0.0),
            ValueError,
            "elastic_timeout: must be > 0",
        ),
        "validation out of range": (dict(validation=1.5), ValueError, "validation: a fraction"),
        "validation not boolean or 0/1": (
            dict(validation="name"),
            TypeError,
            "validation: column 'name' has type string",
        ),
        "validation missing": (dict(validation="nope"), ValueError, "validation: column 'nope'"),
        "batch_size <= 0": (dict(batch_size=0), ValueError, "batch_size: must be >= 1"),
        "epochs <= 0": (dict(epochs=0), ValueError, "epochs: must be >= 1"),
        "input_shapes count": (
            dict(input_shapes=[[-1, 3], [-1]]),
            ValueError,
            "input_shapes: 2 shapes",
        ),
        "input_shapes with a size of 0": (
            dict(input_shapes=[[0, 3]]),
            ValueError,
            "input_shapes: shape [0, 3] for column 'x' must be one row's shape",
        ),
        "input_shapes of a scalar column": (
            dict(feature_cols=["id"], input_shapes=[[-1, 3]]),
            ValueError,
            "input_shapes: shape [-1, 3] has 3 elements per row, but column 'id' has rows of "
            "length 1",
        ),
        "optimizer of another model": (
            dict(model=net, optimizer=torch.optim.SGD(other.parameters(), lr=0.1)),
            ValueError,
            "optimizer: its parameters are not the model's",
        ),
        "unpicklable model": (
            dict(model=bad_net, optimizer=torch.optim.SGD(bad_net.parameters(), lr=0.1)),
            TypeError,
            "model: cannot be serialized",
        ),
        "unpicklable loss": (
            dict(loss=UnpicklableLoss()),
            TypeError,
            "loss: cannot be serialized",
        ),
        "no loss": (dict(loss=None), ValueError, "loss: set exactly one of loss and"),
        "no store": (dict(store=None), ValueError, "store: is required"),
        "store not a Store": (
            dict(store="/tmp/x"),
            TypeError,
            "store: expected a spark_estimator.Store",
        ),
        "finished run_id": (dict(run_id="done"), ValueError, "run_id: run 'done' already finished"),
        "unknown compression": (dict(compression="lzo"), ValueError, "compression: must be one"),
        "unknown dtype": (dict(dtype="float16"), ValueError, "dtype: must be one of"),
        "unknown reader": (dict(reader="parquet"), ValueError, "reader: must be one of"),
        "unknown data_copy": (dict(data_copy="sometimes"), ValueError, "data_copy: must be one"),
        "data_copy never, not a Parquet scan": (
            dict(data_copy="never"),
            ValueError,
            "data_copy: 'never', but the DataFrame cannot be read in place: it reads a ",
        ),
        "shuffle_buffer_size 0": (
            dict(shuffle_buffer_size=0),
            ValueError,
            "shuffle_buffer_size: must be >= 1",
        ),
        "reader_num_workers 0": (
            dict(reader_num_workers=0),
            ValueError,
            "reader_num_workers: must be >= 1",
        ),
        "partitions_per_process 0": (
            dict(partitions_per_process=0),
            ValueError,
            "partitions_per_process: must be >= 1",
        ),
        "row_group_size_mb 0": (
            dict(row_group_size_mb=0),
            ValueError,
            "row_group_size_mb: must be > 0",
        ),
        "train_steps_per_epoch 0": (
            dict(train_steps_per_epoch=0),
            ValueError,
            "train_steps_per_epoch: must be >= 1",
        ),
        "transformation_fn not callable": (
            dict(transformation_fn="scale"),
            TypeError,
            "transformation_fn: expected a function",
        ),
        "missing sample_weight_col": (
            dict(sample_weight_col="nope"),
            ValueError,
            "sample_weight_col: column 'nope'",
        ),
        "string sample_weight_col": (
            dict(sample_weight_col="name"),
            TypeError,
            "sample_weight_col: column 'name' has type string",
        ),
        "loss_weights count": (dict(loss_weights=[1.0, 1.0]), ValueError, "loss_weights: 2"),
        "unknown lr_scaling": (dict(lr_scaling="sqrt"), ValueError, "lr_scaling: must be one"),
        "unknown gradient_reduction": (
            dict(gradient_reduction="sum"),
            ValueError,
            "gradient_reduction: must be one of",
        ),
        "adasum with linear lr_scaling": (
            dict(gradient_reduction="adasum", lr_scaling="linear"),
            ValueError,
            "lr_scaling: must be 'none' with gradient_reduction='adasum'",
        ),
        "unknown mixed_precision": (
            dict(mixed_precision="fp8"),
            ValueError,
            "mixed_precision: must be one of",
        ),
        "compile a string": (dict(compile="inductor"), TypeError, "compile: expected True"),
        "unknown parallelism": (dict(parallelism="tp"), ValueError, "parallelism: must be one"),
        "fsdp with gradient_compression": (
            dict(parallelism="fsdp", gradient_compression="bf16"),
            ValueError,
            "gradient_compression: 'bf16' cannot be combined with parallelism='fsdp'",
        ),
        "fsdp with adasum": (
            dict(parallelism="fsdp", gradient_reduction="adasum"),
            ValueError,
            "gradient_reduction: 'adasum' cannot be combined with parallelism='fsdp'",
        ),
        "fsdp with compile": (
            dict(parallelism="fsdp", compile=True),
            ValueError,
            "compile: torch.compile is not offered with parallelism='fsdp'",
        ),
        "fsdp_wrap without fsdp": (
            dict(fsdp_wrap=[torch.nn.Linear]),
            ValueError,
            "fsdp_wrap: applies only with parallelism='fsdp'",
        ),
        "fsdp_wrap of a class the model lacks": (
            dict(parallelism="fsdp", fsdp_wrap=["Conv2d"]),
            ValueError,
            "fsdp_wrap: the model has no submodule of class ['Conv2d']",
        ),
        "model function with an optimizer object": (
            dict(model=linear_net),
            TypeError,
            "optimizer: model is a function",
        ),
        "ReduceLROnPlateau per step": (
            dict(
                lr_scheduler=lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o),
                lr_scheduler_interval="step",
            ),
            ValueError,
            "lr_scheduler_interval: 'step' cannot drive ReduceLROnPlateau",
        ),
        "backward_passes_per_step 0": (
            dict(backward_passes_per_step=0),
            ValueError,
            "backward_passes_per_step: must be >= 1",
        ),
        "monitor without validation": (
            dict(callbacks=[BestModel("validation.loss")]),
            ValueError,
            "callbacks: BestModel monitors 'validation.loss'",
        ),
        "keep_checkpoints 0": (
            dict(keep_checkpoints=0),
            ValueError,
            "keep_checkpoints: must be >= 1",
        ),
        "collective_timeout 0": (
            dict(collective_timeout=0),
            ValueError,
            "collective_timeout: must be > 0",
        ),
        "use_gpu True without a GPU per task": (
            dict(use_gpu=True),
            ValueError,
            "use_gpu: True requires a GPU for every task, but Spark gives tasks none",
        ),
        "fewer model outputs than label columns": (
            dict(label_cols=["y", "id"], input_shapes=[[-1, 3]]),
            ValueError,
            "label_cols: the model returned 1 outputs for 2 label columns",
        ),
        "loss not per row with sample weights": (
            dict(loss=mean_loss, sample_weight_col="id", input_shapes=[[-1, 3]]),
            ValueError,
            "sample_weight_col: the loss for label column 'y' returned shape ()",
        ),
        "model outputs that do not fit the label": (
            dict(net=linear_net(3, 3), input_shapes=[[-1, 3]]),
            ValueError,
            "torch's MSELoss fails the same way in training: the model returns 3 values per row",
        ),
        "transformation_fn written for Horovod": (
            dict(transformation_fn=pandas_transformation, input_shapes=[[3]]),
            TypeError,
            "transformation_fn: fails on a batch as it is given here",
        ),
        **_petastorm_case(),
    }


def pandas_transformation(df):
    """A transformation_fn as Horovod's estimator calls it: on a pandas DataFrame."""
    df["y"] = df["y"].astype("float32")
    return df


def _petastorm_case() -> dict:
    """Choosing petastorm where it cannot import (pyarrow >= 15) is bad input too."""
    try:
        require_petastorm()
        return {}
    except ImportError:
        return {
            "petastorm on a new pyarrow": (
                dict(reader="petastorm"),
                ImportError,
                "reader: 'petastorm' cannot be used here",
            )
        }


BAD_CASES = list(_bad_inputs()) + list(_data_cases())


def _files(store) -> dict[str, bytes]:
    return {path: store.read_bytes(path) for path in store.fs.find(store.root)}


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_is_rejected_on_the_driver_before_any_job(case, spark, store, monkeypatch):
    """Parameter and schema errors come before any Spark job; bad data comes from the
    materialization's write, before the training job. Either way the store is unchanged."""
    data_case = case in _data_cases()
    if data_case:
        overrides, error, message, rows = _data_cases()[case]
    else:
        (overrides, error, message), rows = _bad_inputs()[case], None
    df = spark.createDataFrame(GOOD_ROWS if rows is None else rows, BAD_SCHEMA)
    store.write_bytes(store.run("done").result, b"an earlier run")
    store.write_bytes(store.dataset("earlier").meta, b"{}")
    before = _files(store)
    launched = []
    monkeypatch.setattr(training_job, "run_barrier_job", lambda *a, **k: launched.append(a))
    overrides = dict(overrides)
    est = make_estimator(overrides.pop("net", linear_net()), store, num_proc=1)
    est.setParams(**overrides)
    group = f"bad-input-{uuid.uuid4().hex}"
    spark.sparkContext.setJobGroup(group, case)
    try:
        with pytest.raises(error, match=re.escape(message)):
            est.fit(df)
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
    jobs = list(spark.sparkContext.statusTracker().getJobIdsForGroup(group))
    if not data_case:
        assert jobs == []  # found before any Spark job
    assert launched == []  # never the training job
    assert store.fs.ls(store.runs, detail=False) == [store.run("done").path]
    assert _files(store) == before  # byte for byte; nothing under runs/ or datasets/ added


def test_docs_list_every_bad_input_case():
    doc = (Path(__file__).parent.parent / "docs" / "bad-input.md").read_text()
    table = [line.split("|") for line in doc.splitlines() if line.startswith("| ")]
    found = {cells[1].strip(): cells[5].strip() for cells in table}  # case -> when found
    found.pop("case")
    petastorm = {"petastorm on a new pyarrow"}  # a case only where petastorm cannot import
    assert set(found) - petastorm == set(BAD_CASES) - petastorm
    by_the_write = {case for case, when in found.items() if when == "materialization"}
    assert by_the_write == set(_data_cases())
