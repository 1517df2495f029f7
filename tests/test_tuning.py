"""OptunaSearch on real local Spark: studies of small distributed fits (2 processes each on
the local[4] session), their pruning, admission, failures, resumption and persistence."""

from __future__ import annotations

import _thread
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from pyspark import SparkContext
from pyspark.ml import Pipeline, PipelineModel

from spark_estimator.driver import materialize
from spark_estimator.shared.serialization import state_dict_digest, state_from_bytes
from tests.conftest import make_estimator

optuna = pytest.importorskip("optuna")
from spark_estimator.tuning import OptunaSearch, OptunaSearchModel  # noqa: E402

States = optuna.trial.TrialState
DRIVER = Path(__file__).with_name("tuning_driver.py")


def lr_space(trial):
    return {"learning_rate": trial.suggest_float("lr", 1e-3, 0.3, log=True)}


class PruneAt(optuna.pruners.BasePruner):
    """Prunes trial ``number`` when it reports epoch ``epoch`` (and calls ``then``)."""

    def __init__(self, number: int, epoch: int, then=None):
        self.number, self.epoch, self.then = number, epoch, then

    def prune(self, study, trial) -> bool:
        hit = trial.number == self.number and trial.last_step == self.epoch
        if hit and self.then is not None:
            return self.then()
        return hit


def weights(model) -> str:
    return state_dict_digest(model.getOrDefault("model").state_dict())


def test_the_best_model_is_the_best_trials_fit_and_saves_and_loads_in_a_pipeline(
    regression_df, store, tmp_path
):
    est = make_estimator(store=store, validation=0.25, epochs=2)
    search = OptunaSearch(
        estimator=est, space=lr_space, n_trials=3, seed=0, pruner=optuna.pruners.NopPruner()
    )
    model = search.fit(regression_df)

    frame = model.trials_dataframe()
    assert list(frame["state"]) == ["complete"] * 3 and list(frame["epochs"]) == [2] * 3
    assert frame["run_id"].nunique() == 3
    best = frame.loc[frame["value"].idxmin()]
    assert model.bestTrial.number == best["number"] and model.bestValue == best["value"]
    assert model.bestModel.getRunId() == best["run_id"]
    assert model.bestModel.getHistory()[-1]["validation"]["loss"] == pytest.approx(best["value"])
    # the best trial's weights are those of a plain fit with its params and seed
    plain = est.copy({est.learning_rate: model.bestParams["lr"]}).fit(regression_df)
    assert weights(plain) == weights(model.bestModel)

    path = str(tmp_path / "search")
    model.write().save(path)
    loaded = OptunaSearchModel.load(path)
    assert loaded.bestParams == model.bestParams and len(loaded.trials) == 3
    assert weights(loaded.bestModel) == weights(model.bestModel)
    assert loaded.trials_dataframe().equals(frame)
    out = loaded.transform(regression_df).select("prediction").collect()
    assert len(out) == 200

    one = search.copy({search.n_trials: 1, search.study_name: "in-a-pipeline"})
    pipeline = Pipeline(stages=[one]).fit(regression_df)
    pipeline.write().save(str(tmp_path / "pipeline"))
    again = PipelineModel.load(str(tmp_path / "pipeline"))
    assert isinstance(again.stages[0], OptunaSearchModel)
    assert again.stages[0].study.study_name == "in-a-pipeline"
    assert again.stages[0].trials[0].params == model.trials[0].params  # seeded: the same trial


def test_a_pruned_trial_stops_at_the_epoch_the_pruner_said_on_every_rank(regression_df, store):
    est = make_estimator(store=store, validation=0.25, epochs=4)
    model = OptunaSearch(
        estimator=est, space=lr_space, n_trials=2, seed=0, pruner=PruneAt(1, 2)
    ).fit(regression_df)

    first, pruned = model.trials
    assert first.state == States.COMPLETE and first.user_attrs["epochs_trained"] == 4
    assert pruned.state == States.PRUNED and pruned.user_attrs["epochs_trained"] == 2
    assert sorted(first.intermediate_values) == [1, 2, 3, 4]
    assert sorted(pruned.intermediate_values) == [1, 2]
    ranks = store.read_json(store.run(pruned.user_attrs["run_id"]).ranks)
    assert [len(r["batches_per_epoch"]) for r in ranks] == [2, 2]
    assert store.checkpoint_epochs(pruned.user_attrs["run_id"])[-1] == 2


def test_parallel_trials_never_exceed_the_slots_and_write_the_dataset_once(
    regression_df, store, monkeypatch
):
    writes = []
    target = materialize.ParquetTarget
    monkeypatch.setattr(
        materialize, "ParquetTarget", lambda *a, **k: writes.append(1) or target(*a, **k)
    )
    est = make_estimator(store=store, validation=0.25, epochs=2)  # 2 of local[4]'s 4 slots
    model = OptunaSearch(
        estimator=est,
        space=lr_space,
        n_trials=4,
        parallelism=3,
        seed=0,
        pruner=optuna.pruners.NopPruner(),
    ).fit(regression_df)

    assert [t.state for t in model.trials] == [States.COMPLETE] * 4
    spans = [(t.datetime_start, t.datetime_complete) for t in model.trials]
    at_once = [sum(s <= start < e for s, e in spans) for start, _ in spans]
    assert max(at_once) == 2  # two trials ran at once, a third waited in the tuner
    assert writes == [1]  # the trials started at once did not each write the data


def test_a_failed_trial_is_recorded_with_its_error_and_the_study_goes_on(regression_df, store):
    est = make_estimator(store=store, validation=0.25, epochs=2)
    diverging = {1: 1e12}  # trial 1's loss is not finite: terminate_on_nan fails its fit

    def space(trial):
        return {"learning_rate": diverging.get(trial.number, 0.05)}

    model = OptunaSearch(estimator=est, space=space, n_trials=3).fit(regression_df)
    assert [t.state for t in model.trials] == [States.COMPLETE, States.FAIL, States.COMPLETE]
    error = model.trials[1].user_attrs["error"]
    assert error.startswith("TrainingError") and "NaN or infinite" in error, error
    assert model.trials_dataframe()["error"].notna().tolist() == [False, True, False]
    assert model.bestTrial.number in (0, 2)


def test_a_study_left_running_goes_on_from_its_trials_checkpoints_to_n_trials(regression_df, store):
    """The driver's loop is interrupted (Ctrl-C, as a killed driver would leave it) while
    trial 1 runs: the journal in the store keeps trial 1 RUNNING and its run's checkpoint
    of epoch 1; a new search of the same study takes it up from there and ends with
    n_trials."""
    search, run_id = interrupted_in_trial_1(regression_df, store, "resumed", n_trials=3)
    left = journal(store, "resumed")
    assert [t.state for t in left.trials] == [States.COMPLETE, States.RUNNING]

    again = search.copy({search.pruner: optuna.pruners.NopPruner()})
    model = again.fit(regression_df)
    assert [t.state for t in model.trials] == [States.COMPLETE] * 3, model.trials
    assert model.trials[1].user_attrs["run_id"] == run_id
    assert model.trials[1].params == left.trials[1].params
    result = state_from_bytes(store.read_bytes(store.run(run_id).result))
    assert result["summary"]["resumed_from_epoch"] == 1 and len(result["history"]) == 3
    assert model.trials[1].user_attrs["epochs_trained"] == 3


def journal(store, name: str):
    """The study ``name`` as its journal in the store holds it."""
    backend = optuna.storages.journal.JournalFileBackend(store.study_journal(name))
    return optuna.load_study(study_name=name, storage=optuna.storages.JournalStorage(backend))


def drive(store, *args: str, killed: bool = False) -> str:
    """Run a driver of a study in the store (tests/tuning_driver.py) in a process group of
    its own; ``killed``: it SIGKILLs the group where its arguments say. Its stderr (the
    trials' lines)."""
    proc = subprocess.run(
        [sys.executable, str(DRIVER), store.url.removeprefix("file://"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=DRIVER.parents[1],
        start_new_session=True,
    )
    assert proc.returncode == (-signal.SIGKILL if killed else 0), proc.stderr[-5000:]
    return proc.stderr


def trial_lines(stderr: str) -> dict[int, str]:
    return {int(line.split()[1]): line for line in stderr.splitlines() if line.startswith("trial ")}


def run_result(store, run_id: str) -> dict:
    return state_from_bytes(store.read_bytes(store.run(run_id).result))


@pytest.mark.parametrize("data", ["parquet", "rows"])
def test_a_study_whose_driver_was_killed_mid_trial_goes_on_from_its_checkpoints_in_a_new_driver(
    data, store
):
    """The driver (and its Spark) is SIGKILLed while trial 2 waits for the answer to its
    epoch 3; a new driver of the study, on the same rows (Parquet read in place, or
    ``createDataFrame`` of the same list), resumes trial 2 from its epoch 2 checkpoint
    and asks new trials, none with the params of an earlier one."""
    drive(store, "--data", data, "--kill-at-report", "2:3", killed=True)
    left = journal(store, "killed").trials
    assert [t.state for t in left] == [States.COMPLETE, States.COMPLETE, States.RUNNING]
    run_id = left[2].user_attrs["run_id"]
    assert store.checkpoint_epochs(run_id) == [1, 2]
    # seed: an uninterrupted run's trials are those of a TPESampler with that seed
    same = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0))
    assert [t.params["lr"] for t in left] == [lr_space(same.ask())["learning_rate"] for _ in left]
    checkpoints = [Path(store.run(run_id).checkpoint(e)).stat().st_mtime_ns for e in (1, 2)]

    lines = trial_lines(drive(store, "--data", data))
    trials = journal(store, "killed").trials
    assert [t.state for t in trials] == [States.COMPLETE] * 4, [t.user_attrs for t in trials]
    assert trials[2].user_attrs["run_id"] == run_id
    result = run_result(store, run_id)
    assert result["summary"]["resumed_from_epoch"] == 2 and len(result["history"]) == 4
    assert [Path(store.run(run_id).checkpoint(e)).stat().st_mtime_ns for e in (1, 2)] == (
        checkpoints
    )  # epochs 1 and 2 were not trained again
    assert trials[2].user_attrs["epochs_trained"] == 4
    assert lines[2].startswith("trial 2 complete, 4/4 epochs"), lines
    assert len({t.params["lr"] for t in trials}) == 4, [t.params for t in trials]
    assert len(store.fs.ls(store.runs)) == 4  # no trial fit twice


def test_a_trial_whose_fit_ended_unrecorded_keeps_its_run_and_is_fit_again_as_a_new_trial(store):
    """Three drivers of one study, each killed after a trial's fit ended and before the
    trial was recorded: trial 1 (pruned at epoch 2) is recorded pruned with its own run's
    value and epochs; trial 2 (complete, its model lost with its driver) is recorded failed
    with its run and fit again as trial 3, a new trial with its params, whose pruner sees
    only its own run's reports."""
    args = ("--study", "refit", "--data", "parquet")
    drive(store, *args, "--prune", "1:2", "--kill-at-tell", "1", killed=True)
    pruned_run = journal(store, "refit").trials[1].user_attrs["run_id"]
    drive(store, *args, "--kill-at-tell", "2", killed=True)
    lines = trial_lines(drive(store, *args, "--median"))

    trials = journal(store, "refit").trials
    assert [t.number for t in trials] == [0, 1, 2, 3, 4]
    pruned, lost, again = trials[1], trials[2], trials[3]
    assert pruned.state == States.PRUNED and pruned.user_attrs["run_id"] == pruned_run
    history = run_result(store, pruned_run)["history"]
    assert pruned.user_attrs["epochs_trained"] == len(history) == 2
    assert pruned.value == pytest.approx(history[-1]["validation"]["loss"])
    assert sorted(pruned.intermediate_values) == [1, 2]

    assert lost.state == States.FAIL and lost.user_attrs["epochs_trained"] == 4
    assert len(run_result(store, lost.user_attrs["run_id"])["history"]) == 4
    assert "fit again as trial 3" in lost.user_attrs["error"], lost.user_attrs
    assert again.params == lost.params
    assert again.user_attrs["run_id"] != lost.user_attrs["run_id"]
    history = run_result(store, again.user_attrs["run_id"])["history"]
    epochs = again.user_attrs["epochs_trained"]
    assert epochs == len(history) >= 2  # MedianPruner(n_warmup_steps=2): never before 2
    assert again.intermediate_values == pytest.approx(
        {e: r["validation"]["loss"] for e, r in enumerate(history, 1)}
    )  # its own run's reports only
    if again.state == States.COMPLETE:
        assert again.value == pytest.approx(history[-1]["validation"]["loss"])
        assert lines[3].startswith("trial 3 complete, 4/4 epochs"), lines
    else:
        assert again.state == States.PRUNED
        assert lines[3].startswith(f"trial 3 pruned at epoch {epochs}/4"), lines
    assert len({t.params["lr"] for t in trials}) == 4  # trial 3 repeats trial 2 only


def test_a_resumed_trial_that_fails_counts_the_epochs_of_its_checkpoints(
    regression_df, store, monkeypatch, capsys
):
    """Trial 1, left running with its epoch 1 checkpoint, is taken up on other rows, which
    its run refuses: it failed after the 1 epoch it trained, as its line and its row say."""
    from spark_estimator.driver import study as study_module

    search, _ = interrupted_in_trial_1(regression_df, store, "other-rows", n_trials=2)
    monkeypatch.setattr(study_module, "logging_configured", lambda log: False)
    capsys.readouterr()
    again = search.copy({search.pruner: optuna.pruners.NopPruner()})
    model = again.fit(regression_df.where("id < 150"))
    failed = model.trials_dataframe().iloc[1]
    assert failed["state"] == "fail" and failed["epochs"] == 1, failed
    assert "another data" in failed["error"] or "differ" in failed["error"], failed["error"]
    line = trial_lines(capsys.readouterr().err)[1]
    assert line.startswith("trial 1 failed after 1 epoch | lr="), line


def interrupted_in_trial_1(df, store, study_name: str, n_trials: int):
    """A search of the study ``study_name`` in the store (3 epochs a trial) whose driver's
    loop is interrupted while trial 1 waits after its epoch 1 checkpoint (checked); the
    search and trial 1's run id."""
    est = make_estimator(store=store, validation=0.25, epochs=3, max_restarts=0)
    search = OptunaSearch(
        estimator=est,
        space=lr_space,
        n_trials=n_trials,
        seed=0,
        storage="store",
        study_name=study_name,
        pruner=PruneAt(1, 2, then=_interrupt_and_wait),
    )
    with pytest.raises(KeyboardInterrupt):
        search.fit(df)
    run_id = journal(store, study_name).trials[1].user_attrs["run_id"]
    assert store.checkpoint_epochs(run_id) == [1]
    return search, run_id


def _interrupt_and_wait() -> bool:
    """Ctrl-C in the driver's main thread while rank 0 waits for this answer, which comes
    once Spark has ended the trial's job (a rank that outlives it is answered "abort")."""
    jobs = SparkContext._active_spark_context.statusTracker()
    _thread.interrupt_main()
    deadline = time.monotonic() + 60
    while jobs.getActiveJobsIds() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    return False


def test_bad_searches_are_refused_on_the_driver_naming_the_param(
    spark, regression_df, store, monkeypatch
):
    est = make_estimator(store=store, validation=0.25)

    def refused(**params) -> str:
        with pytest.raises((ValueError, TypeError, ImportError)) as e:
            OptunaSearch(**{"estimator": est, "n_trials": 2, **params}).fit(regression_df)
        return str(e.value)

    assert refused(space=lambda t: {"lr": 0.1}).startswith(
        "space: 'lr' is not a param of TorchEstimator; did you mean 'learning_rate'"
    )
    assert refused(space=lambda t: {"run_id": "x"}).startswith("space: 'run_id' is set by")
    with pytest.raises(ValueError, match="^run_id: the estimator's is 'mine'"):
        OptunaSearch(estimator=est.copy({est.run_id: "mine"}), space=lr_space, n_trials=1).fit(
            regression_df
        )
    assert refused(space=lr_space, metric="validation.accuracy").startswith(
        "metric: 'validation.accuracy' is not recorded by this fit; it records"
    )
    no_validation = est.copy({est.validation: None})
    with pytest.raises(
        ValueError,
        match="^metric: 'validation.loss' is not recorded by this fit "
        r"\(the estimator has no validation data\)",
    ):
        OptunaSearch(estimator=no_validation, space=lr_space, n_trials=1).fit(regression_df)
    assert refused(space=lr_space, storage="store", study_name="x", n_trials=None).startswith(
        "n_trials, timeout: give at least one"
    )
    assert refused(space=lr_space, n_trials=0) == "n_trials: must be >= 1, got 0"
    assert refused(space=lr_space, timeout=0) == "timeout: must be > 0 seconds, got 0.0"
    assert refused(space=lr_space, parallelism=0) == "parallelism: must be >= 1, got 0"
    assert refused(space=lr_space, direction="up") == (
        "direction: must be one of ['minimize', 'maximize'], got 'up'"
    )
    assert not store.exists(store.runs) and not store.exists(store.datasets)  # no fit ran
    monkeypatch.setitem(__import__("sys").modules, "optuna", None)
    assert "pip install 'spark-estimator[tune]'" in refused(space=lr_space)


def test_a_lightning_module_built_from_the_trial_is_pruned_through_its_callback(
    regression_df, store
):
    """One trial (Lightning fits are slow to start), pruned: the search ends with no trial
    complete, which it says; the study it was given holds the trial."""
    pl = pytest.importorskip("lightning.pytorch")
    from spark_estimator import LightningEstimator

    class Regressor(pl.LightningModule):
        def __init__(self, width: int, lr: float):
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(3, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)
            )
            self.lr = lr

        def forward(self, x):
            return self.net(x).squeeze(-1)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self(batch["x"]), batch["y"])

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", torch.nn.functional.mse_loss(self(batch["x"]), batch["y"]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    def space(trial):
        width = trial.suggest_categorical("width", [5, 7])
        return {"model": Regressor(width, trial.suggest_float("lr", 0.01, 0.1, log=True))}

    est = LightningEstimator(
        model=Regressor(4, 0.1),
        feature_cols=["x"],
        label_cols=["y"],
        batch_size=16,
        epochs=3,
        num_proc=2,
        validation=0.25,
        store=store,
        use_gpu=False,
    )
    study = optuna.create_study(pruner=PruneAt(0, 2))
    search = OptunaSearch(estimator=est, space=space, metric="val_loss", n_trials=1, study=study)
    with pytest.raises(RuntimeError, match=r"no trial of study '.*' completed \(1 pruned\)"):
        search.fit(regression_df)

    (pruned,) = study.trials
    assert pruned.state == States.PRUNED and pruned.user_attrs["epochs_trained"] == 2
    assert sorted(pruned.intermediate_values) == [1, 2]
    run = store.run(pruned.user_attrs["run_id"])
    assert [len(r["batches_per_epoch"]) for r in store.read_json(run.ranks)] == [2, 2]
    history = state_from_bytes(store.read_bytes(run.result))["history"]
    assert pruned.intermediate_values[2] == pytest.approx(history[-1]["validation"]["val_loss"])
    width = pruned.params["width"]  # the module was the trial's
    assert store.read_json(run.manifest)["model"]["net.0.weight"][0] == [width, 3]


def test_each_trial_is_a_nested_mlflow_run_of_the_study(regression_df, store, mlflow_tracking):
    est = make_estimator(store=store, validation=0.25, epochs=2, mlflow_logging=True)
    model = OptunaSearch(
        estimator=est,
        space=lr_space,
        n_trials=2,
        seed=0,
        study_name="logged",
        pruner=optuna.pruners.NopPruner(),
    ).fit(regression_df)

    (experiment,) = [e for e in mlflow_tracking.search_experiments()]
    runs = mlflow_tracking.search_runs([experiment.experiment_id])
    (study,) = [r for r in runs if r.info.run_name == "logged"]
    trials = sorted(
        (r for r in runs if r.data.tags.get("mlflow.parentRunId") == study.info.run_id),
        key=lambda r: int(r.data.tags["optuna.trial_number"]),
    )
    assert [r.info.run_name for r in trials] == ["trial-0", "trial-1"]
    for run, trial in zip(trials, model.trials):
        assert run.data.params["run_id"] == trial.user_attrs["run_id"]  # the fit's own log
        assert run.data.metrics["trial_value"] == pytest.approx(trial.value)
        assert float(run.data.params["trial.lr"]) == pytest.approx(trial.params["lr"])
        assert "validation/loss" in run.data.metrics
    # the best model: an MLflow Model of the study's run, predicting as bestModel does
    import mlflow

    assert study.data.tags["optuna.best_trial"] == str(model.bestTrial.number)
    logged = mlflow.pyfunc.load_model(f"runs:/{study.info.run_id}/model")
    rows = regression_df.limit(5)
    predicted = logged.predict(rows.select(*est.getFeatureCols()).toPandas())["prediction"]
    expected = model.transform(rows).select("prediction").toPandas()["prediction"]
    assert predicted.tolist() == pytest.approx(expected.tolist(), rel=1e-5)


def test_an_evaluator_judges_the_validation_rows_and_the_search_saves_and_loads(
    regression_df, store, tmp_path
):
    from pyspark.ml.evaluation import RegressionEvaluator
    from pyspark.sql import functions as F

    df = regression_df.withColumn("held_out", F.col("id") % 4 == 0)
    est = make_estimator(store=store, validation="held_out", epochs=2)
    r2 = RegressionEvaluator(labelCol="y", metricName="r2")  # larger is better
    search = OptunaSearch(
        estimator=est,
        space=lr_space,
        evaluator=r2,
        n_trials=2,
        seed=0,
        study_name="judged",
        pruner=optuna.pruners.NopPruner(),
    )
    model = search.fit(df)

    assert model.study.direction == optuna.study.StudyDirection.MAXIMIZE
    held_out = df.where("held_out")
    assert model.bestValue == pytest.approx(r2.evaluate(model.bestModel.transform(held_out)))
    assert model.bestValue == max(t.value for t in model.trials)
    losses = [r["validation"]["loss"] for r in model.bestModel.getHistory()]
    # validation.loss, which is minimized, is reported negated to the maximizing study
    reported = model.bestTrial.intermediate_values
    assert [reported[e] for e in (1, 2)] == pytest.approx([-v for v in losses])

    path = str(tmp_path / "search")
    search.write().save(path)
    loaded = OptunaSearch.load(path)
    assert (loaded.getNTrials(), loaded.getStudyName()) == (2, "judged")
    assert loaded.getEstimator().getValidation() == "held_out"
    assert loaded.getEstimator().getStore().url == store.url
    assert loaded.getSpace()(optuna.trial.FixedTrial({"lr": 0.01})) == {"learning_rate": 0.01}
    assert loaded.getEvaluator().getMetricName() == "r2"
    assert isinstance(loaded.getPruner(), optuna.pruners.NopPruner)


def test_a_study_in_a_storage_url_goes_on_in_a_later_search_which_times_out_at_once(
    regression_df, store, tmp_path, monkeypatch, capsys
):
    """A sampler and a storage URL given, the lines printed where no logging is configured;
    a later search of the same study whose timeout has passed asks for no trial and returns
    the earlier best trial's model, saved in its run."""
    from spark_estimator.driver import study as study_module

    monkeypatch.setattr(study_module, "logging_configured", lambda log: False)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    est = make_estimator(store=store, validation=0.25, epochs=2)
    first = OptunaSearch(
        estimator=est,
        space=lr_space,
        n_trials=2,
        storage=url,
        study_name="urls",
        sampler=optuna.samplers.RandomSampler(seed=3),
        pruner=optuna.pruners.NopPruner(),
    ).fit(regression_df)

    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("trial ")]
    assert sorted(line.split(" complete, 2/2 epochs: validation.loss ")[0] for line in lines) == [
        "trial 0",
        "trial 1",
    ]
    same = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    drawn = [lr_space(same.ask())["learning_rate"] for _ in range(2)]
    assert [t.params["lr"] for t in first.trials] == drawn

    later = OptunaSearch(
        estimator=est, space=lr_space, timeout=1e-6, storage=url, study_name="urls"
    ).fit(regression_df)
    assert len(optuna.load_study(study_name="urls", storage=url).trials) == 2
    assert later.bestTrial.number == first.bestTrial.number
    assert weights(later.bestModel) == weights(first.bestModel)
