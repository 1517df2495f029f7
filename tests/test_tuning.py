"""OptunaSearch on real local Spark: studies of small distributed fits (2 processes each on
the local[4] session), their pruning, admission, failures, resumption and persistence."""

from __future__ import annotations

import _thread
import threading
import time

import pytest
import torch
from pyspark.ml import Pipeline, PipelineModel

from spark_estimator.driver import materialize
from spark_estimator.shared.serialization import state_dict_digest
from tests.conftest import make_estimator

optuna = pytest.importorskip("optuna")
from spark_estimator.tuning import OptunaSearch, OptunaSearchModel  # noqa: E402

States = optuna.trial.TrialState


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
