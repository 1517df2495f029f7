"""Tuning: Optuna studies whose trials are distributed fits, pruned epoch by epoch.

    from spark_estimator.tuning import OptunaSearch, OptunaSearchModel

``OptunaSearch`` is a Spark ML Estimator: ``fit(df)`` runs an Optuna study in which every
trial is one fit of the tuned TorchEstimator or LightningEstimator (one barrier job of its
``num_proc`` tasks) with the params the search space gives it, reports the trial's metric
after every epoch so the study's pruner can stop it at that epoch's end, and returns an
``OptunaSearchModel`` holding the best trial's fitted TorchModel. The study's loop runs on
the driver (``driver.study``); docs/tuning.md tells the whole story. Optuna is an optional
extra: ``pip install 'spark-estimator[tune]'``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pyspark.ml import Estimator, Model
from pyspark.sql import DataFrame

from .driver import mlflow_log, validate
from .driver.constructors import OptunaSearchConstructor
from .driver.fit import StoreEstimator
from .driver.params import OBJECT_PARAMS, SearchParams
from .driver.persistence import NestedStagesReadWrite, in_store
from .driver.study import StudyRun, open_storage, require_optuna, study_sampler
from .driver.trials import EPOCHS_ATTR, ERROR_ATTR, FIT_SECONDS_ATTR, RUN_ID_ATTR, check_evaluator
from .model import TorchModel

DIRECTIONS = ("minimize", "maximize")
__all__ = ["OptunaSearch", "OptunaSearchModel"]


class OptunaSearch(OptunaSearchConstructor, Estimator, SearchParams, NestedStagesReadWrite):
    """Tunes a TorchEstimator or LightningEstimator with an Optuna study of distributed fits.

    Each trial is one fit of a copy of ``estimator`` with the params ``space(trial)`` gives
    it. After every epoch the trial's ``metric`` is reported to the trial, and where the
    study's pruner says so the fit stops at that epoch's end on every rank. Up to
    ``parallelism`` trials run at once where the cluster has the task slots for all of them;
    the others wait in the tuner. All trials train from one dataset (materialized once). A
    failed trial is recorded with its error and the study goes on. With a ``storage`` the
    study survives its driver: a later fit of the same ``study_name`` takes the trials that
    were running up again from their runs' last checkpoints (on the same rows, however the
    DataFrame was built) and goes on to ``n_trials``, its sampler seeded anew so that no
    trial repeats an earlier one's params; a trial whose model was lost with its driver is
    fit again as a new trial.

    The constructor's Parameters section (``help(OptunaSearch.__init__)``),
    ``explainParams()`` and docs/parameters.md describe every parameter; docs/tuning.md
    the rest.

    Examples
    --------
    >>> from spark_estimator.tuning import OptunaSearch
    >>> def space(trial):
    ...     width = trial.suggest_categorical("width", [16, 32, 64])
    ...     return {"learning_rate": trial.suggest_float("lr", 1e-4, 1e-1, log=True),
    ...             "model": lambda: make_net(width)}
    >>> search = OptunaSearch(estimator=est, space=space, n_trials=16, parallelism=2)
    >>> model = search.fit(df)                                          # doctest: +SKIP
    >>> model.bestParams, model.bestValue                               # doctest: +SKIP
    >>> model.transform(df)                                             # doctest: +SKIP
    """

    _NESTED = ("estimator", "evaluator")

    def setParams(self, **params):
        """Set several params at once by name, e.g. ``setParams(n_trials=20)``."""
        return self._set(**params)

    def fit(self, dataset: DataFrame, params: dict | list[dict] | None = None):
        """Run the study on a DataFrame and return the best trial's model.

        Every param is checked on the driver before any trial, and the search space and the
        metric with the first trial's params, before its fit.

        Parameters
        ----------
        dataset : pyspark.sql.DataFrame
            The rows every trial trains on, as the estimator's ``fit`` takes them.
        params : dict or list of dict, optional
            Param values overriding this search's for this fit, as in any Spark ML
            Estimator.

        Returns
        -------
        OptunaSearchModel
            The best trial's fitted TorchModel (``bestModel``; ``transform`` goes through
            it), the study and every trial's params, value, state, epochs and run.

        Raises
        ------
        ImportError
            Optuna is not installed on the driver.
        ValueError, TypeError
            A param that cannot work, or a space or metric the first trial's fit cannot
            use, named in the message's first word, before any trial trains.
        RuntimeError
            No trial completed (each failed or was pruned): the first failure's error.

        Examples
        --------
        >>> model = OptunaSearch(estimator=est, space=space, n_trials=8).fit(df)  # doctest: +SKIP
        >>> model.trials_dataframe()[["number", "state", "value", "epochs"]]      # doctest: +SKIP
        """
        return super().fit(dataset, params)

    def _fit(self, dataset: DataFrame) -> OptunaSearchModel:
        optuna = require_optuna()
        self._check()
        study, sign = self._study(optuna)
        run = StudyRun(self, dataset, study, sign)
        run.run()
        model = self._model(optuna, study, run.models)
        if run.parent_run is not None:  # mlflow_logging: the best model in the study's run
            code_paths = self.getOrDefault("estimator").getMlflowCodePaths()
            mlflow_log.log_best(
                run.parent_run, model.bestModel, model.bestTrial, dataset, code_paths
            )
        return model

    def _check(self) -> None:
        estimator = self.getOrDefault("estimator") if self.isDefined("estimator") else None
        if not isinstance(estimator, StoreEstimator):
            raise TypeError(
                "estimator: expected a TorchEstimator or LightningEstimator, got "
                f"{type(estimator).__name__}"
            )
        if not self.isDefined("space") or not callable(self.getSpace()):
            raise TypeError("space: expected a function optuna.Trial -> dict of params")
        n_trials, timeout = self.getNTrials(), self.getTimeout()
        if n_trials is None and timeout is None:
            raise ValueError("n_trials, timeout: give at least one, else the study never ends")
        validate.check_positive("n_trials", n_trials, optional=True)
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout: must be > 0 seconds, got {timeout}")
        validate.check_positive("parallelism", self.getParallelism())
        validate.check_choice("direction", self.getDirection(), DIRECTIONS)
        metric = self.getMetric()
        if estimator._TRAINER != "lightning":
            split, dot, name = metric.partition(".")
            if split not in ("train", "validation") or not dot or not name:
                raise ValueError(
                    f"metric: expected '<split>.<name>' of the history, e.g. 'validation.loss' "
                    f"or 'train.accuracy', got {metric!r}"
                )
        check_evaluator(self.getEvaluator(), estimator)
        if estimator.getStore() is None:
            raise ValueError("store: the estimator needs a store (its trials' runs go there)")
        if estimator.getRunId() is not None:
            raise ValueError(
                f"run_id: the estimator's is {estimator.getRunId()!r}, but OptunaSearch gives "
                "each trial a run of its own; unset it (estimator.clear(estimator.run_id))"
            )

    def _study(self, optuna) -> tuple[Any, float]:
        """The study the trials go into, and the sign that gives ``metric`` its direction."""
        evaluator = self.getEvaluator()
        if evaluator is not None:
            wanted = "maximize" if evaluator.isLargerBetter() else "minimize"
        else:
            wanted = self.getDirection()
        study = self.getStudy()
        if study is not None:
            for name in ("study_name", "sampler", "pruner", "storage", "seed"):
                if self.isSet(name):
                    raise ValueError(
                        f"{name}: set on the study given as the study param, not beside it"
                    )
        else:
            name = self.getStudyName() or (
                f"spark-estimator-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
            )
            storage = open_storage(self.getStorage(), self.getEstimator().getStore(), name)
            sampler, seed = self.getSampler(), self.getSeed()
            study = optuna.create_study(
                storage=storage,
                sampler=study_sampler(sampler, seed, 0),
                pruner=self.getPruner() or optuna.pruners.MedianPruner(),
                study_name=name,
                direction=wanted,
                load_if_exists=True,
            )
            held = len(study.get_trials(deepcopy=False))
            if held:  # a later fit of the study: a sampler that does not draw again
                study.sampler = study_sampler(sampler, seed, held)
        if len(study.directions) != 1:
            raise ValueError("study: has several objectives; OptunaSearch optimizes one value")
        direction = study.direction.name.lower()
        if direction != wanted:
            why = "the evaluator's" if evaluator is not None else "direction"
            raise ValueError(
                f"study: '{study.study_name}' is to {direction} its value, but {why} says {wanted}"
            )
        return study, 1.0 if self.getDirection() == wanted else -1.0

    def _model(self, optuna, study, models: dict) -> OptunaSearchModel:
        trials = study.get_trials(deepcopy=True)
        states = optuna.trial.TrialState
        if not any(t.state == states.COMPLETE for t in trials):
            counts = ", ".join(
                f"{sum(t.state == s for t in trials)} {s.name.lower()}"
                for s in states
                if any(t.state == s for t in trials)
            )
            failed = [t for t in trials if ERROR_ATTR in t.user_attrs]
            first = (
                f"; trial {failed[0].number}: {failed[0].user_attrs[ERROR_ATTR]}" if failed else ""
            )
            raise RuntimeError(
                f"OptunaSearch: no trial of study '{study.study_name}' completed ({counts}){first}"
            )
        best = study.best_trial
        model = models.get(best.number)
        if model is None:  # the best trial finished in an earlier fit of the study
            store = self.getEstimator().getStore()
            reader = TorchModel.read()
            model = reader.load(
                in_store(reader, store, store.run(best.user_attrs[RUN_ID_ATTR]).tuned_model)
            )
        return OptunaSearchModel(model, study, trials)

    # -- persistence (NestedStagesReadWrite) ------------------------------------------------
    def _nested(self) -> dict:
        return {name: self.getOrDefault(name) for name in self._NESTED if self.isDefined(name)}

    def _objects(self) -> dict:
        return {
            p.name: self.getOrDefault(p)
            for p in self.params
            if p.name in OBJECT_PARAMS and p.name not in self._NESTED and self.isSet(p)
        }

    def _extra_metadata(self) -> dict:
        return {}

    def _restore(self, objects: dict, metadata: dict) -> None:
        self._set(**objects)

    def _restore_nested(self, stages: dict) -> None:
        self._set(**stages)


class OptunaSearchModel(Model, NestedStagesReadWrite):
    """What ``OptunaSearch.fit`` returns: the best trial's fitted TorchModel
    (``bestModel``), which ``transform`` goes through, the Optuna ``study`` and its
    ``trials`` (``trials_dataframe()``).

    Saves and loads with Spark ML's ``write()`` / ``load()`` (the best model in its folder
    ``bestModel/``, as CrossValidatorModel's); a loaded model's ``study`` is the saved
    trials in a study in memory.

    Examples
    --------
    >>> model = OptunaSearch(estimator=est, space=space, n_trials=8).fit(df)  # doctest: +SKIP
    >>> model.bestParams, model.bestValue, model.bestModel.getHistory()[-1]  # doctest: +SKIP
    >>> model.write().save("/models/search")                                # doctest: +SKIP
    >>> OptunaSearchModel.load("/models/search").transform(df)              # doctest: +SKIP
    """

    _NESTED = ("bestModel",)

    def __init__(self, bestModel: TorchModel | None = None, study=None, trials: list | None = None):
        super().__init__()
        self.bestModel = bestModel
        self._study = study
        self.trials = list(trials or [])  # optuna FrozenTrials, in trial order

    @property
    def study(self):
        """The optuna.Study (after ``load``: one in memory holding the saved trials)."""
        if self._study is None and self.trials:
            optuna = require_optuna()
            direction = self._direction or "minimize"
            self._study = optuna.create_study(direction=direction, study_name=self._name)
            self._study.add_trials(self.trials)
        return self._study

    _direction: str | None = None
    _name: str | None = None

    @property
    def bestTrial(self):
        """The best trial (an optuna FrozenTrial)."""
        return self.study.best_trial

    @property
    def bestParams(self) -> dict:
        """The best trial's suggested params."""
        return dict(self.bestTrial.params)

    @property
    def bestValue(self) -> float:
        return float(self.bestTrial.value)

    def trials_dataframe(self):
        """Every trial as a row of a pandas DataFrame.

        Returns
        -------
        pandas.DataFrame
            One row per trial, in trial order: ``number``, ``state`` ("complete", "pruned",
            "fail" or "running"), ``value``, ``epochs`` (trained), ``run_id`` (its run in
            the store), ``fit_seconds``, ``duration_s`` (from its start to its end, on
            the driver), ``error`` (a failed trial's) and ``params_<name>`` per suggested
            param.

        Examples
        --------
        >>> frame = model.trials_dataframe()                                 # doctest: +SKIP
        >>> spark.createDataFrame(frame).show()                              # doctest: +SKIP
        """
        import pandas as pd

        rows = []
        for t in self.trials:
            attrs = t.user_attrs
            row = {
                "number": t.number,
                "state": t.state.name.lower(),
                "value": t.value,
                "epochs": attrs.get(EPOCHS_ATTR),
                "run_id": attrs.get(RUN_ID_ATTR),
                "fit_seconds": attrs.get(FIT_SECONDS_ATTR),
                "duration_s": t.duration.total_seconds() if t.duration else None,
                "error": attrs.get(ERROR_ATTR),
            }
            row.update({f"params_{k}": v for k, v in t.params.items()})
            rows.append(row)
        return pd.DataFrame(rows)

    def _transform(self, dataset: DataFrame) -> DataFrame:
        return self.bestModel.transform(dataset)

    def copy(self, extra: dict | None = None) -> OptunaSearchModel:
        """A copy whose best model is ``bestModel.copy(extra)``; the study is shared."""
        copied = OptunaSearchModel(self.bestModel.copy(extra), self._study, self.trials)
        copied._resetUid(self.uid)
        copied._direction, copied._name = self._direction, self._name
        return copied

    # -- persistence (NestedStagesReadWrite) ------------------------------------------------
    def _nested(self) -> dict:
        return {"bestModel": self.bestModel}

    def _objects(self) -> dict:
        study = self.study
        return {
            "trials": self.trials,
            "direction": study.direction.name.lower() if study else None,
            "study_name": study.study_name if study else None,
        }

    def _extra_metadata(self) -> dict:
        return {}

    def _restore(self, objects: dict, metadata: dict) -> None:
        self.trials = list(objects["trials"])
        self._direction, self._name = objects["direction"], objects["study_name"]

    def _restore_nested(self, stages: dict) -> None:
        self.bestModel = stages["bestModel"]
