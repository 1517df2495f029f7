"""Driver: one trial of a tuning study, as a fit of the tuned estimator.

``plan_trial`` turns an Optuna trial into the estimator that fits it: a copy of the tuned
estimator with the params the search space gives for the trial (checked: each a param of
the estimator, none the tuner sets itself), the trial's own ``run_id`` (kept in the trial's
user attributes, so a later fit of a resumed study finds the run and its checkpoints) and
the callback by which rank 0 asks the tuner after each epoch whether to go on
(``shared.pruning``). ``check_metric`` refuses, before any trial, a metric the fit does not
record. ``trial_value`` is a finished fit's value; ``trained_epochs`` the epochs a trial's
run trained (its checkpoints from an earlier fit included); ``ended_run`` what a run that
ended unrecorded (its driver gone) tells of its trial; ``trial_line`` the line the driver
shows for a finished trial.
"""

from __future__ import annotations

import difflib
import uuid
from dataclasses import dataclass, field
from typing import Any

from pyspark.ml.param import Param
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from ..shared.packages import lightning_package
from ..shared.pruning import TrialPruning, history_value, lightning_trial_pruning
from ..shared.serialization import state_from_bytes
from . import validate_lightning, validate_training

RUN_ID_ATTR = "run_id"  # the trial's user attribute naming its run in the store
EPOCHS_ATTR = "epochs_trained"
ERROR_ATTR = "error"
# a trial whose fit ended but was not recorded (its driver gone): the trial fit again in its
# place (on the closed one), and the closed one's number (on the new one)
FIT_AGAIN_AS_ATTR = "fit_again_as"
FIT_AGAIN_OF_ATTR = "fit_again_of"
FIT_SECONDS_ATTR = "fit_seconds"  # the trial's fit, as its training summary times it
# params the tuner sets on every trial's estimator itself
TUNER_PARAMS = {"run_id": "each trial's run in the store, named by the tuner"}


@dataclass
class TrialPlan:
    """What a trial fits, and what the tuner learns of it while it runs."""

    trial: Any  # the optuna.Trial
    estimator: Any  # the tuned estimator's copy with the trial's params
    run_id: str
    procs: int  # the task slots its fit takes
    resumed: bool = False  # a running trial of an earlier fit, taken up again
    reported: list[tuple[int, float]] = field(default_factory=list)  # (epoch, value)
    reported_before: set[int] = field(default_factory=set)  # a resumed trial's epochs
    pruned_at: int | None = None

    @property
    def number(self) -> int:
        return self.trial.number


def is_lightning(estimator) -> bool:
    return getattr(estimator, "_TRAINER", None) == "lightning"


def trial_params(estimator, mapping) -> dict[str, Any]:
    """The search space's answer for a trial as param name -> value, checked: a dict whose
    keys are params of ``estimator`` (names or Params) that the tuner does not set."""
    if not isinstance(mapping, dict):
        raise TypeError(
            f"space: must return a dict of the estimator's params and their values, got "
            f"{type(mapping).__name__}"
        )
    params = {}
    for key, value in mapping.items():
        name = key.name if isinstance(key, Param) else key
        if not isinstance(name, str) or not estimator.hasParam(name):
            known = [p.name for p in estimator.params]
            initials = [k for k in known if "".join(w[0] for w in k.split("_")) == name]
            close = initials + difflib.get_close_matches(str(name), known, n=3)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise ValueError(
                f"space: {name!r} is not a param of {type(estimator).__name__}{hint} (the "
                "space returns the estimator's params, e.g. {'learning_rate': "
                "trial.suggest_float('lr', 1e-4, 1e-1, log=True)})"
            )
        if name in TUNER_PARAMS:
            raise ValueError(f"space: {name!r} is set by OptunaSearch: {TUNER_PARAMS[name]}")
        params[name] = value
    return params


def plan_trial(base, trial, space, metric: str, slots: int, resumed: bool = False) -> TrialPlan:
    """The fit of ``trial``: ``base`` with the params ``space(trial)`` gives (a resumed
    trial's suggestions are its own again), its run (the one it had, when resumed) and the
    pruning callback; it takes its ``num_proc`` of the ``slots`` (all where unset)."""
    params = trial_params(base, space(trial))
    estimator = base.copy({base.getParam(name): value for name, value in params.items()})
    store = estimator.getStore()
    run_id = trial.user_attrs.get(RUN_ID_ATTR) if resumed else None
    if run_id is None:
        run_id = f"trial-{trial.number}-{uuid.uuid4().hex[:8]}"
        trial.set_user_attr(RUN_ID_ATTR, run_id)
    if is_lightning(estimator):
        pl = lightning_package(estimator.getModel())
        pruning = lightning_trial_pruning(pl)(store, run_id, metric)
    else:
        pruning = TrialPruning(store, run_id, metric)
    extra = {"run_id": run_id, "callbacks": [*(estimator.getCallbacks() or []), pruning]}
    if "verbose" not in params:  # one line per trial instead of a progress bar per fit
        extra["verbose"] = False
    estimator = estimator.copy({estimator.getParam(k): v for k, v in extra.items()})
    procs = estimator.getNumProc() or slots
    return TrialPlan(trial, estimator, run_id, min(procs, slots) or procs, resumed)


def trained_epochs(store, run_id: str, reported: list[tuple[int, float]]) -> int:
    """The epochs a trial's run has trained: its newest checkpoint's (an earlier fit's
    included), or the last epoch this fit reported, whichever is later."""
    done = store.checkpoint_epochs(run_id) if store.exists(store.run(run_id).path) else []
    return max([*done[-1:], *(epoch for epoch, _ in reported), 0])


def ended_run(store, run_id: str) -> tuple[int, bool]:
    """A finished run's epochs (its history's) and whether the tuner pruned it (its last
    epoch's answer)."""
    run = store.run(run_id)
    epochs = len(state_from_bytes(store.read_bytes(run.result))["history"])
    answer = run.trial_answer(epochs)
    said = store.read_json(answer) if epochs and store.exists(answer) else {}
    return epochs, bool(said.get("prune")) and not said.get("abort")


def check_metric(estimator, metric: str) -> None:
    """A ValueError naming ``metric`` where the fit of ``estimator`` does not record it
    each epoch: for TorchEstimator a ``split.name`` of its history (validation only with
    validation data); for LightningEstimator a name its module logs (one logged only in
    its validation hooks needs validation data)."""
    has_validation = estimator.getValidation() is not None
    if is_lightning(estimator):
        model = estimator.getModel()
        if not has_validation and metric in validate_lightning.validation_names(model):
            raise ValueError(
                f"metric: {type(model).__name__} logs '{metric}' in its validation hooks, but "
                "the estimator has no validation data; set its validation param or tune on a "
                "value logged in training"
            )
        return
    recorded = validate_training.recorded_metrics(
        list(estimator.getMetrics() or {}), estimator.getLabelCols(), has_validation
    )
    if metric not in recorded:
        why = ""
        if metric.startswith("validation.") and not has_validation:
            why = " (the estimator has no validation data)"
        raise ValueError(
            f"metric: '{metric}' is not recorded by this fit{why}; it records {recorded}"
        )


def validation_rows(df: DataFrame, estimator) -> DataFrame:
    """The rows an evaluator judges a trial's model on: those the estimator's validation
    column marks."""
    return df.where(F.coalesce(F.col(estimator.getValidation()).cast("boolean"), F.lit(False)))


def check_evaluator(evaluator, estimator) -> None:
    """An evaluator judges the rows of the estimator's validation column (a fraction would
    split the rows again, and not as the fit did)."""
    if evaluator is None:
        return
    if not hasattr(evaluator, "evaluate") or not hasattr(evaluator, "isLargerBetter"):
        raise TypeError(
            f"evaluator: expected a pyspark.ml.evaluation.Evaluator, got {type(evaluator).__name__}"
        )
    if not isinstance(estimator.getValidation(), str):
        raise ValueError(
            "evaluator: judges each trial's model on the rows of the estimator's validation "
            f"column; the estimator's validation is {estimator.getValidation()!r}: set it to a "
            "boolean column marking the validation rows"
        )


def trial_value(plan: TrialPlan, model, metric: str, evaluator, df: DataFrame) -> float:
    """A complete trial's value: ``evaluator`` on the model's transform of the validation
    rows; else ``metric`` of the epoch whose weights the model has (a BestModel's or
    ModelCheckpoint's selection of that metric, else the last epoch)."""
    if evaluator is not None:
        return float(evaluator.evaluate(model.transform(validation_rows(df, plan.estimator))))
    selection = model.getTrainingSummary().get("selection") or {}
    if selection.get("monitor") == metric and selection.get("value") is not None:
        return float(selection["value"])
    return history_value(model.getHistory()[-1], metric, is_lightning(plan.estimator))


def shown_params(params: dict) -> str:
    return ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()
    )


def trial_line(
    number: int,
    params: dict,
    total: int,
    state: str,
    epochs: int,
    value,
    metric: str,
    seconds: float | None,
    best: bool = False,
    error: str | None = None,
) -> str:
    """The driver's line for a finished trial: its number, state, epochs (of ``total``),
    value, params, ``error`` (or a note) and its ``seconds`` (where known)."""
    head = f"trial {number}"
    if state == "pruned":
        head += f" pruned at epoch {epochs}/{total}"
    elif state == "complete":
        head += f" complete, {epochs}/{total} epochs"
    else:
        head += f" failed after {epochs} epoch{'s' if epochs != 1 else ''}"
    shown = f"{metric} {value:.4g}" if isinstance(value, float) else ""
    if best:
        shown += " (best so far)"
    parts = [head + (f": {shown}" if shown else ""), shown_params(params)]
    if error:
        parts.append(error)
    if seconds is not None:
        parts.append(f"{seconds:.1f} s")
    return " | ".join(p for p in parts if p)
