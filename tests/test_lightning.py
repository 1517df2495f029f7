"""LightningEstimator end to end on a real local[4] Spark session (2 training processes)."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from pyspark.sql import functions as F

from spark_estimator import LightningEstimator, Store, TorchEstimator, TorchModel, TrainingError
from spark_estimator.driver import run_manifest, validate_lightning
from spark_estimator.shared import packages
from spark_estimator.shared.serialization import state_from_bytes
from spark_estimator.shared.summary import RankSummary
from tests.conftest import LOCAL, cnn, digits_rows, run_user_script, spark_session

pl = pytest.importorskip("lightning.pytorch")
EarlyStopping, ModelCheckpoint = pl.callbacks.EarlyStopping, pl.callbacks.ModelCheckpoint


class DigitsModule(pl.LightningModule):
    """The conftest CNN on digits, trained the Lightning way."""

    def __init__(self, lr: float = 3e-3, seed: int = 0):
        super().__init__()
        self.save_hyperparameters()
        self.net = cnn(seed)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        logits = self(batch["features"])
        loss = torch.nn.functional.cross_entropy(logits, batch["label"])
        self.log("train_acc", (logits.argmax(1) == batch["label"]).float().mean(), on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        logits = self(batch["features"])
        self.log("val_loss", torch.nn.functional.cross_entropy(logits, batch["label"]))
        self.log("val_acc", (logits.argmax(1) == batch["label"]).float().mean())

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


def accuracy(model, df) -> float:
    predicted = F.expr("array_position(prediction, array_max(prediction)) - 1")
    out = model.transform(df)
    return out.select(F.avg((predicted == F.col("label")).cast("double"))).first()[0]


# what the Lightning fits and the plain estimator they are compared with share
DIGITS_PARAMS = dict(
    feature_cols=["features"],
    label_cols=["label"],
    input_shapes=[[-1, 1, 8, 8]],
    batch_size=32,
    epochs=6,
    num_proc=2,
    validation=0.2,
    random_seed=42,
    use_gpu=False,
)


def lightning_estimator(store, **params) -> LightningEstimator:
    defaults = dict(DIGITS_PARAMS, model=DigitsModule(), store=store)
    return LightningEstimator(**{**defaults, **params})


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    spark = spark_session(LOCAL)
    store = Store.create(str(tmp_path_factory.mktemp("lightning") / "store"))
    train, test = spark.createDataFrame(digits_rows(), ["features", "label"]).randomSplit(
        [0.8, 0.2], seed=7
    )
    return store, train, test


@pytest.fixture(scope="module")
def lightning_fit(digits):
    store, train, test = digits
    est = lightning_estimator(store, run_id="lightning-digits")
    return est, est.fit(train)


@pytest.fixture(scope="module")
def plain_fit(digits):
    """The same fit with TorchEstimator and our own loop."""
    store, train, _ = digits
    net = cnn()
    return TorchEstimator(
        model=net,
        optimizer=torch.optim.Adam(net.parameters(), lr=3e-3),
        loss=torch.nn.CrossEntropyLoss(),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
        store=store,
        **DIGITS_PARAMS,
    ).fit(train)


def test_a_lightning_module_reaches_the_plain_estimators_accuracy_on_two_ranks(
    digits, lightning_fit, plain_fit
):
    store, train, test = digits
    _, model = lightning_fit
    ours, theirs = accuracy(model, test), accuracy(plain_fit, test)
    assert ours >= 0.9
    assert ours >= theirs - 0.03, (ours, theirs)


def test_both_trainers_report_the_same_fields_per_rank_counted_the_same_way(
    digits, lightning_fit, plain_fit
):
    store = digits[0]

    def ranks(model):
        return store.read_json(store.run(model.getRunId()).ranks)

    ours, theirs = ranks(lightning_fit[1]), ranks(plain_fit)
    fields = {f.name for f in dataclasses.fields(RankSummary)}
    assert [set(r) for r in ours] == [set(r) for r in theirs] == [fields, fields]
    # the same data, batch size and ranks: each loop counted the same batches and steps
    for key in ("train_rows", "validation_rows", "batches_per_epoch", "optimizer_steps_per_epoch"):
        assert [r[key] for r in ours] == [r[key] for r in theirs], key
    assert [len(r["batches_per_epoch"]) for r in ours] == [6, 6]


def test_history_holds_the_loss_and_what_the_module_logged_per_epoch(lightning_fit):
    _, model = lightning_fit
    history = model.getHistory()
    assert [h["epoch"] for h in history] == [1, 2, 3, 4, 5, 6]
    assert [h["num_proc"] for h in history] == [2] * 6
    assert set(history[0]["train"]) == {"loss", "train_acc"}
    assert set(history[0]["validation"]) == {"val_loss", "val_acc"}
    assert history[-1]["validation"]["val_loss"] < history[0]["validation"]["val_loss"] / 2
    assert history[-1]["train"]["loss"] < history[0]["train"]["loss"] / 2
    # configure_optimizers' StepLR(step_size=3, gamma=0.5) stepped once per epoch
    assert [h["lr"] for h in history] == [[3e-3]] * 3 + [[1.5e-3]] * 3
    summary = model.getTrainingSummary()
    assert summary["trainer"] == "lightning" and summary["world_size"] == 2
    assert summary["epochs_run"] == 6 and not summary["stopped_early"]


def test_both_ranks_trained_their_shards_and_rank_zero_checkpointed_every_epoch(
    digits, lightning_fit
):
    store, train, _ = digits
    _, model = lightning_fit
    ranks = store.read_json(store.run("lightning-digits").ranks)
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert len({r["weights_digest"] for r in ranks}) == 1
    assert len({r["pid"] for r in ranks}) == 2
    assert abs(ranks[0]["train_rows"] - ranks[1]["train_rows"]) <= 1
    # each rank reports its own shard of the validation rows, as TorchEstimator's do
    assert abs(ranks[0]["validation_rows"] - ranks[1]["validation_rows"]) <= 1
    assert sum(r["train_rows"] + r["validation_rows"] for r in ranks) == train.count()
    # two CPU processes of one host: the gradients went through shared memory, every step
    for r in ranks:
        steps = sum(r["batches_per_epoch"])
        assert r["gradient_path"] == "shared memory"
        assert r["gradient_allreduces"] and r["gradient_allreduces"] % steps == 0
    assert store.checkpoint_epochs("lightning-digits") == [1, 2, 3, 4, 5, 6]
    saved = state_from_bytes(store.read_bytes(store.run("lightning-digits").checkpoint(6)))
    assert saved["epoch"] == 5  # Lightning counts from 0
    assert set(saved["state_dict"]) == set(model.getModel().state_dict())
    assert len(saved["callbacks"]["spark_estimator"]["history"]) == 6
    tensorboard = store.run("lightning-digits").tensorboard
    assert store.exists(tensorboard)


def test_the_fitted_model_transforms_with_forward_and_saves_and_loads(
    digits, lightning_fit, tmp_path
):
    _, _, test = digits
    _, model = lightning_fit
    assert isinstance(model.getModel(), DigitsModule)
    path = str(tmp_path / "model")
    model.save(path)
    loaded = TorchModel.load(path)
    assert isinstance(loaded.getModel(), DigitsModule)
    assert accuracy(loaded, test) == accuracy(model, test)


def test_early_stopping_ends_the_fit_on_every_rank(digits):
    store, train, _ = digits
    # an improvement of 10 in val_loss never comes: stop after patience=1 epoch
    stop = EarlyStopping(monitor="val_loss", min_delta=10.0, patience=1)
    est = lightning_estimator(
        store, callbacks=[stop], epochs=6, trainer_args={"accumulate_grad_batches": 2}
    )
    summary = est.fit(train).getTrainingSummary()
    assert summary["epochs_run"] == 2
    assert summary["stopped_early"] and summary["early_stopping_epoch"] == 2
    assert summary["accumulate_grad_batches"] == 2


def test_model_checkpoint_keeps_its_best_file_and_the_model_takes_its_weights(digits):
    store, train, _ = digits
    best = ModelCheckpoint(monitor="val_acc", mode="max", save_top_k=1)
    est = lightning_estimator(store, callbacks=[best], epochs=4, run_id="best", keep_checkpoints=1)
    model = est.fit(train)
    summary = model.getTrainingSummary()
    assert store.checkpoint_epochs("best") == [4]
    accuracies = [h["validation"]["val_acc"] for h in model.getHistory()]
    assert summary["selection"]["monitor"] == "val_acc"
    assert summary["selected_epoch"] == 1 + max(range(4), key=lambda i: (accuracies[i], -i))
    path = summary["selection"]["path"]
    assert path.startswith(store.run("best").lightning) and store.exists(path)
    saved = state_from_bytes(store.read_bytes(path))
    for name, value in model.getModel().state_dict().items():
        assert torch.equal(value, saved["state_dict"][name])


class FailAt(pl.Callback):
    """Raises on ``rank`` when ``epoch`` (1-based) starts."""

    def __init__(self, rank: int, epoch: int):
        self.rank, self.epoch = rank, epoch

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.global_rank == self.rank and trainer.current_epoch + 1 == self.epoch:
            raise ValueError(f"injected fault at epoch {self.epoch}")


def test_a_failed_fit_resumes_from_its_last_checkpoint_as_if_it_had_not_failed(digits):
    store, train, _ = digits
    small = dict(epochs=3, validation=None, train_steps_per_epoch=10)
    straight = lightning_estimator(store, run_id="straight", **small).fit(train)
    failing = lightning_estimator(store, run_id="resumed", callbacks=[FailAt(1, 3)], **small)
    with pytest.raises(TrainingError, match="injected fault at epoch 3"):
        failing.fit(train)
    assert store.checkpoint_epochs("resumed") == [1, 2]
    resumed = lightning_estimator(store, run_id="resumed", **small).fit(train)
    assert resumed.getTrainingSummary()["resumed_from_epoch"] == 2
    assert [h["epoch"] for h in resumed.getHistory()] == [1, 2, 3]
    assert resumed.getHistory() == straight.getHistory()
    expected = straight.getModel().state_dict()
    for name, value in resumed.getModel().state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)


def test_a_finished_run_fit_again_with_more_epochs_trains_on_from_its_last_checkpoint(digits):
    store, train, _ = digits
    small = dict(epochs=3, validation=None, train_steps_per_epoch=10)
    straight = lightning_estimator(store, run_id="three", **small).fit(train)
    lightning_estimator(store, run_id="two-then-three", **{**small, "epochs": 2}).fit(train)
    further = lightning_estimator(store, run_id="two-then-three", **small).fit(train)
    assert further.getTrainingSummary()["resumed_from_epoch"] == 2
    assert further.getHistory() == straight.getHistory()
    expected = straight.getModel().state_dict()
    for name, value in further.getModel().state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)


def test_classification_gives_the_module_double_labels_as_class_indices(digits):
    """StringIndexer's labels are doubles: with classification=True the module's
    cross_entropy gets them as int64, as TorchEstimator's loss does."""
    store, train, _ = digits
    doubles = train.withColumn("label", F.col("label").cast("double"))
    small = dict(epochs=1, validation=None, train_steps_per_epoch=3, classification=True)
    model = lightning_estimator(store, **small).fit(doubles)
    assert len(model.getHistory()) == 1 and model.getClassification()


def test_a_fit_runs_each_driver_check_once(digits, spy):
    store, train, _ = digits
    names = ["check_module", "check_callbacks", "check_trainer_args", "check_monitors"]
    calls = {name: spy(validate_lightning, name) for name in names}
    calls.update({name: spy(run_manifest, name) for name in ("check_resume", "check_resume_data")})
    lightning_estimator(
        store,
        epochs=1,
        train_steps_per_epoch=2,
        validation_steps_per_epoch=1,
        callbacks=[EarlyStopping(monitor="val_loss")],
        run_id="lightning-checked-once",
    ).fit(train)
    assert {name: len(c) for name, c in calls.items()} == dict.fromkeys(calls, 1)


def own_store(tmp_path) -> Store:
    """A store of the test's own, holding an earlier run's result and a dataset, which a
    refused fit must leave as they are. (The module's shared store may still get the last
    lines of an earlier test's failed job, from a task Spark kills after the job ended.)"""
    store = Store.create(str(tmp_path / "store"))
    store.write_bytes(store.run("done").result, b"an earlier run")
    store.write_bytes(store.dataset("earlier").meta, b"{}")
    return store


def test_bad_lightning_input_is_refused_on_the_driver_before_any_job(digits, monkeypatch, tmp_path):
    _, train, _ = digits
    store = own_store(tmp_path)
    before = sorted(p for p in store.fs.find(store.root))
    cases = [
        (dict(model=cnn()), TypeError, "model: expected a LightningModule"),
        (dict(callbacks=[object()]), TypeError, "callbacks: .* is not a lightning.pytorch"),
        (dict(trainer_args={"max_epochs": 3}), ValueError, "'max_epochs' is set by the .* epochs"),
        (dict(trainer_args={"max_epoch": 3}), ValueError, "'max_epoch' is not an argument"),
        (dict(trainer_args=["precision"]), TypeError, "trainer_args: expected a dict"),
        (dict(keep_checkpoints=0), ValueError, "keep_checkpoints: must be >= 1"),
        (
            dict(profiler="simple", trainer_args={"profiler": "simple"}),
            ValueError,
            "profiler: set both as the profiler param and in trainer_args",
        ),
        (dict(profiler=3), TypeError, "profiler: expected"),
    ]
    for params, error, message in cases:
        with pytest.raises(error, match=message):
            lightning_estimator(store, **params).fit(train)
    monkeypatch.setattr(packages, "PACKAGES", ("no_such_lightning",))
    with pytest.raises(ImportError, match=r"spark-estimator\[lightning\]"):
        lightning_estimator(store).fit(train)
    assert sorted(p for p in store.fs.find(store.root)) == before


def test_a_monitor_of_a_validation_value_without_validation_fails_on_the_driver(digits, tmp_path):
    _, train, _ = digits
    store = own_store(tmp_path)
    est = lightning_estimator(
        store, validation=None, run_id="unvalidated", callbacks=[EarlyStopping(monitor="val_loss")]
    )
    refused = r"callbacks: EarlyStopping monitors 'val_loss'.*no validation data.*validation="
    before = sorted(p for p in store.fs.find(store.root))
    with pytest.raises(ValueError, match=refused):
        est.fit(train)
    assert sorted(p for p in store.fs.find(store.root)) == before
    # Parquet without validation rows, known once fit_on_parquet has read it
    path = lightning_estimator(store, validation=None).materialize(train)
    with pytest.raises(ValueError, match=refused):
        est.fit_on_parquet(path)
    assert not store.exists(store.run("unvalidated").path)


def test_the_estimator_saves_and_loads_with_its_module_callbacks_and_trainer_args(tmp_path):
    store = Store.create(str(tmp_path / "store"))
    est = lightning_estimator(
        store, callbacks=[EarlyStopping(monitor="val_loss")], trainer_args={"precision": "bf16"}
    )
    est.save(str(tmp_path / "est"))
    loaded = LightningEstimator.load(str(tmp_path / "est"))
    assert isinstance(loaded.getModel(), DigitsModule)
    assert isinstance(loaded.getCallbacks()[0], EarlyStopping)
    assert loaded.getTrainerArgs() == {"precision": "bf16"}
    assert loaded.getEpochs() == 6 and loaded.getStore().url == store.url


def test_a_profiler_reaches_every_ranks_trainer_and_saves_with_the_estimator(digits, tmp_path):
    """Horovod's LightningEstimator(profiler=...) argument: the Trainer's profiler."""
    store, train, _ = digits
    reports = tmp_path / "profiles"
    profiler = pl.profilers.SimpleProfiler(dirpath=str(reports), filename="perf")
    est = lightning_estimator(store, epochs=1, profiler=profiler)
    est.fit(train)
    # Lightning names the file by local rank, 0 in every task: both ranks append their report
    written = {p.name: p.read_text().count("FIT Profiler Report") for p in reports.iterdir()}
    assert written == {"fit-perf-0.txt": 2}
    est.save(str(tmp_path / "est"))
    loaded = LightningEstimator.load(str(tmp_path / "est")).getProfiler()
    assert isinstance(loaded, pl.profilers.SimpleProfiler) and loaded.filename == "perf"
    assert lightning_estimator(store, profiler="advanced").getProfiler() == "advanced"


class CountingModule(DigitsModule):
    """Logs how many batches each epoch had and the largest feature value it saw."""

    def training_step(self, batch, batch_idx):
        self.log("batches", 1.0, reduce_fx="sum", on_step=False, on_epoch=True)
        self.log("max_x", batch["features"].max(), reduce_fx="max", on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.log("batches", 1.0, reduce_fx="sum", on_step=False, on_epoch=True)
        return super().validation_step(batch, batch_idx)


def test_steps_per_epoch_and_the_transformation_reach_the_module(digits):
    store, train, _ = digits

    def double(batch):
        return {**batch, "features": batch["features"] * 2}

    model = lightning_estimator(
        store,
        model=CountingModule(),
        epochs=2,
        train_steps_per_epoch=7,
        validation_steps_per_epoch=3,
        transformation_fn=double,
    ).fit(train)
    for record in model.getHistory():
        assert record["train"]["batches"] == 7 and record["validation"]["batches"] == 3
        assert 1.0 < record["train"]["max_x"] <= 2.0  # digits are scaled to [0, 1]


def test_a_float64_fit_gives_a_model_that_transforms_float64_inputs(digits, tmp_path):
    store, train, test = digits
    small = dict(epochs=1, num_proc=1, validation=None, train_steps_per_epoch=5)
    est = lightning_estimator(store, model=DigitsModule().double(), dtype="float64", **small)
    model = est.fit(train)
    assert model.getDtype() == "float64"
    model.save(str(tmp_path / "model"))
    loaded = TorchModel.load(str(tmp_path / "model"))
    assert loaded.getDtype() == "float64"
    rows = loaded.transform(test.limit(20)).collect()
    x = torch.tensor([r.features.toArray() for r in rows], dtype=torch.float64)
    expected = loaded.getModel()(x.reshape(-1, 1, 8, 8)).float().tolist()
    assert [r.prediction for r in rows] == [pytest.approx(e, rel=1e-6) for e in expected]


def test_the_default_logger_keeps_step_values_and_learning_rate_monitor_works(digits):
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    store, train, _ = digits
    lightning_estimator(
        store,
        run_id="logged",
        epochs=2,
        validation=None,
        train_steps_per_epoch=5,
        callbacks=[pl.callbacks.LearningRateMonitor(logging_interval="step")],
        trainer_args={"log_every_n_steps": 1},
    ).fit(train)
    logs = EventMultiplexer().AddRunsFromDirectory(store.run("logged").lightning).Reload()
    scalars = {tag: run for run, tags in logs.Runs().items() for tag in tags["scalars"]}
    assert {"train_acc_step", "train_acc_epoch", "lr-Adam"} <= set(scalars)
    steps = [e.step for e in logs.Scalars(scalars["train_acc_step"], "train_acc_step")]
    assert steps == list(range(10))  # every step of both epochs
    lrs = [e.value for e in logs.Scalars(scalars["lr-Adam"], "lr-Adam")]
    assert len(lrs) == 10 and lrs[0] == pytest.approx(3e-3)


class NanOnRank1(DigitsModule):
    """A NaN loss on rank 1 at the third step of epoch 2 (5 steps per epoch)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        bad = self.global_rank == 1 and self.current_epoch == 1 and batch_idx == 2
        return loss * float("nan") if bad else loss


def test_terminate_on_nan_stops_a_lightning_fit_and_keeps_the_last_good_checkpoint(digits):
    store, train, _ = digits
    small = dict(model=NanOnRank1(), epochs=3, validation=None, train_steps_per_epoch=5)
    with pytest.raises(TrainingError, match=r"terminate_on_nan: .* epoch 2, step 3 \(rank 1"):
        lightning_estimator(store, run_id="nan-lightning", **small).fit(train)
    assert store.checkpoint_epochs("nan-lightning") == [1]
    model = lightning_estimator(store, terminate_on_nan=False, **small).fit(train)
    assert math.isnan(model.getHistory()[1]["train"]["loss"])


class RowMeans(pl.LightningModule):
    """Logs per-row values of each batch that depend on the data only, so their exact mean
    over an epoch's rows is known from the DataFrame."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.net(x).squeeze(1)

    def training_step(self, batch, batch_idx):
        y = batch["y"]
        self.log("y", y.mean(), batch_size=len(y), on_step=False, on_epoch=True)
        self.log("y_sq", (y * y).mean(), batch_size=len(y), on_epoch=True, sync_dist=True)
        return torch.nn.functional.mse_loss(self(batch["x"]), y)

    def validation_step(self, batch, batch_idx):
        y = batch["y"]
        self.log("val_y", y.mean(), batch_size=len(y), sync_dist=True)
        self.log("val_y_local", y.mean(), batch_size=len(y))
        self.log("val_y_implicit", y.mean())  # Lightning takes the batch size from the batch
        self.log("val_one", 1.0, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_logged_epoch_means_are_exact_over_all_rows_of_an_uneven_split(digits):
    """41 training rows (21 + 20 on two processes) and 25 validation rows (13 + 12), in
    batches of 4 rows or 3: the history, ModelCheckpoint's and EarlyStopping's values are
    each value's mean over all rows, with and without sync_dist."""
    store = digits[0]
    spark = spark_session(LOCAL)
    rows = [
        ([i / 66, (i * 7 % 11) / 11, 1.0], i / 8 + (i * 37 % 17) / 10, i >= 41) for i in range(66)
    ]
    df = spark.createDataFrame(rows, "x array<double>, y double, held_out boolean")
    train_y = [y for _, y, held_out in rows if not held_out]
    val_y = [y for _, y, held_out in rows if held_out]
    stops = [
        EarlyStopping(monitor="val_y", patience=5),
        EarlyStopping(monitor="y_sq", patience=5, check_on_train_epoch_end=True),
    ]
    best = ModelCheckpoint(monitor="val_y_local", mode="max")
    model = LightningEstimator(
        model=RowMeans(),
        feature_cols=["x"],
        label_cols=["y"],
        validation="held_out",
        batch_size=4,
        epochs=2,
        num_proc=2,
        use_gpu=False,
        callbacks=[*stops, best],
        store=store,
        run_id="uneven-means",
    ).fit(df)
    ranks = store.read_json(store.run("uneven-means").ranks)
    assert sorted(r["validation_rows"] for r in ranks) == [12, 13]
    assert sorted(r["train_rows"] for r in ranks) == [20, 21]
    val_mean = pytest.approx(sum(val_y) / 25, rel=1e-6)
    assert [record["epoch"] for record in model.getHistory()] == [1, 2]
    for record in model.getHistory():
        assert record["train"]["y"] == pytest.approx(sum(train_y) / 41, rel=1e-6)
        assert record["train"]["y_sq"] == pytest.approx(sum(y * y for y in train_y) / 41, rel=1e-6)
        validation = record["validation"]
        assert validation["val_one"] == 1.0
        assert [validation[k] for k in ("val_y", "val_y_local", "val_y_implicit")] == [val_mean] * 3
    # what Lightning's own callbacks monitored: the same values
    assert model.getTrainingSummary()["selection"]["value"] == val_mean
    saved = state_from_bytes(store.read_bytes(store.run("uneven-means").checkpoint(2)))
    monitored = [float(saved["callbacks"][stop.state_key]["best_score"]) for stop in stops]
    assert monitored == [val_mean, pytest.approx(sum(y * y for y in train_y) / 41, rel=1e-6)]


LIGHTNING_SCRIPT = """
import tempfile, torch
import lightning.pytorch as pl
from pyspark.sql import SparkSession
from spark_estimator import LightningEstimator, Store

class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.net(x).squeeze(1)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self(batch["x"]), batch["y"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
rows = [([i / 64, 1.0, -1.0], i / 32) for i in range(64)]
df = spark.createDataFrame(rows, "x array<double>, y double")
LightningEstimator(
    model=Module(), feature_cols=["x"], label_cols=["y"], batch_size=16, epochs=3, num_proc=2,
    use_gpu=False, store=Store.create(tempfile.mkdtemp()),
).fit(df)
"""


def test_a_lightning_fit_shows_lightnings_lines_once_and_none_of_its_checkpoints(tmp_path):
    done = run_user_script(tmp_path, LIGHTNING_SCRIPT)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.strip() for f in done.stderr.split("\r") for line in f.splitlines()]
    # our own checkpoint saving and loading: nothing of Lightning's about it
    assert not [line for line in lines if "weights_only" in line]
    # Lightning's own lines: once, as rank 0's logging
    stopped = [line for line in lines if "`max_epochs=3` reached" in line]
    assert len(stopped) == 1 and stopped[0].startswith("[rank 0] INFO "), stopped
    # Lightning's warnings (deprecations, tips) once, from rank 0, not once per rank
    own = re.compile(r"/(lightning|pytorch_lightning|lightning_fabric)/|Tip:|deprecated")
    warned = [line for line in lines if line.startswith("[rank") and own.search(line)]
    assert warned and all(line.startswith("[rank 0] ") for line in warned), warned
    assert len(warned) == len(set(warned)), warned
