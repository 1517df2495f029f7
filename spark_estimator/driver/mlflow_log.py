"""Driver: log a finished fit to MLflow (the ``mlflow_logging`` param; the ``mlflow`` extra).

What is logged, into the active MLflow run, or else into a new run named by the fit's
``run_id`` in the current experiment (MLflow's tracking URI and experiment settings apply):

- params: every param with a plain value (defaults included), the class names of the
  object-valued ones (``model``, ``optimizer``, ``loss``...), the store's URL and ``run_id``;
- metrics: per epoch (``step`` = epoch), ``train/<name>`` and ``validation/<name>`` for the
  loss and every metric, and ``lr/group_<i>``, the names TensorBoard shows;
- the fitted TorchModel as an MLflow Model named ``model`` (``mlflow_model.log_model``: the
  Spark ML stage with MLmodel beside it, its signature from the fit's columns, its input
  example the dataset's first rows, the user's own modules it needs in its ``code/``
  folder), which ``mlflow.pyfunc.load_model("runs:/<id>/model")`` and
  ``TorchModel.load(<downloaded folder>)`` both read.

An MLflow failure is a warning, never a failed fit (see ``log_fit``).

A tuning study (``OptunaSearch`` with ``mlflow_logging``) has a run of its own, and each of
its trials a run nested under it, active in the trial's thread, into which the trial's fit
logs as above (``study_run``, ``trial_run``).
"""

from __future__ import annotations

import contextlib
import logging

from pyspark.ml.param import Params

from ..shared.history import epoch_scalars
from . import mlflow_model
from .params import OBJECT_PARAMS

log = logging.getLogger(__name__)
_MAX_PARAM_CHARS = 500  # MLflow limits a param's value; object reprs are cut to this


def check_installed() -> None:
    try:
        import mlflow
    except ImportError as e:
        raise ValueError(
            "mlflow_logging: MLflow is not installed; pip install 'spark-estimator[mlflow]' "
            "(or mlflow) on the driver, or set mlflow_logging=False"
        ) from e
    if int(mlflow.__version__.split(".")[0]) < 3:
        raise ValueError(
            f"mlflow_logging: MLflow {mlflow.__version__} is installed; the model is logged as "
            "an MLflow 3 model: pip install 'spark-estimator[mlflow]' (or 'mlflow>=3')"
        )


def check_code_paths(logging: bool, code_paths: list[str] | None) -> None:
    """``mlflow_code_paths`` before any job: existing files and folders, given with
    ``mlflow_logging`` (nothing else reads it)."""
    if code_paths is None:
        return
    if not logging:
        raise ValueError(
            "mlflow_code_paths: given without mlflow_logging=True, and only the model that "
            "mlflow_logging logs ships it; set mlflow_logging=True, or log a fitted model "
            "with spark_estimator.mlflow.log_model(model, code_paths=...)"
        )
    mlflow_model.checked_code_paths(code_paths, "mlflow_code_paths")


def logged_params(estimator: Params, run_id: str) -> dict[str, str]:
    """The params as MLflow takes them: strings, object params by their class name."""
    logged = {"run_id": run_id}
    for param in estimator.params:
        if not estimator.isDefined(param):
            continue
        value = estimator.getOrDefault(param)
        if value is None:
            continue
        if param.name == "store":
            value = value.url
        elif param.name in OBJECT_PARAMS:
            value = _names(value)
        logged[param.name] = str(value)[:_MAX_PARAM_CHARS]
    return logged


def _names(value) -> str:
    """A function's or class's name, an object's class name; of each, for a list or dict."""
    if isinstance(value, dict):
        return ",".join(map(str, value))
    items = value if isinstance(value, (list, tuple)) else [value]
    return ",".join(getattr(v, "__name__", type(v).__name__) for v in items)


def log_fit(estimator: Params, model, store=None, data=None) -> str | None:
    """Log ``estimator``'s params and the fitted ``model`` (a TorchModel; its input example
    from the fit's dataset ``data`` in ``store`` where given); return the MLflow run's id,
    or None when MLflow failed.

    A failure of MLflow (its server, or a refusal such as a second fit inside one active
    run, which would change a logged param's value) is logged as a warning on this
    module's logger and does not fail the fit: its model is trained and saved already."""
    try:
        return _log_fit(estimator, model, store, data)
    except Exception as e:
        log.warning(
            "mlflow_logging: MLflow could not log run %s (%s: %s); the fitted model is "
            "returned, its MLflow record may be missing or incomplete",
            model.getRunId(),
            type(e).__name__,
            e,
        )
        return None


def _log_fit(estimator: Params, model, store, data) -> str:
    import mlflow

    active = mlflow.active_run()
    run = contextlib.nullcontext(active) if active else mlflow.start_run(run_name=model.getRunId())
    with run as current:
        mlflow.log_params(logged_params(estimator, model.getRunId()))
        for record in model.getHistory():
            mlflow.log_metrics(epoch_scalars(record), step=record["epoch"])
        example = None
        if data is not None:
            example = mlflow_model.example_rows(store, data, model.getFeatureCols())
        code_paths = estimator.getOrDefault("mlflow_code_paths")
        mlflow_model.log_model(model, "model", input_example=example, code_paths=code_paths)
        return current.info.run_id


# -- tuning: a study's run and its trials' nested runs ---------------------------------------
# MLflow's active run is per thread: a study's trials fit in threads of their own, each in a
# run of its own nested under the study's, so each trial's fit logs into its own run.


@contextlib.contextmanager
def study_run(study_name: str):
    """The MLflow run a study's trials nest under, while the block runs: the active run of
    this thread, or a new one named by the study (ended after the block). Yields its id;
    None where MLflow failed (a warning: the search goes on without it)."""
    try:
        import mlflow

        active = mlflow.active_run()
        run = None if active else mlflow.start_run(run_name=study_name)
        run_id = (active or run).info.run_id
    except Exception as e:
        log.warning(
            "mlflow_logging: MLflow could not start the study's run (%s: %s)", type(e).__name__, e
        )
        yield None
        return
    try:
        yield run_id
    finally:
        if run is not None:
            mlflow.end_run()


def log_best(parent_run_id: str, model, trial, dataset, code_paths=None) -> None:
    """The study's best model (the best trial's fitted TorchModel) logged as the MLflow
    Model ``model`` of the study's run ``parent_run_id``, as a fit's model is logged (its
    input example the first rows of the study's ``dataset``, the estimator's
    ``code_paths``), with the best trial's number, value and params; a failure of MLflow
    is a warning."""
    try:
        import mlflow

        active = mlflow.active_run()
        resumed = active is None or active.info.run_id != parent_run_id
        run = mlflow.start_run(run_id=parent_run_id) if resumed else contextlib.nullcontext()
        with run:
            mlflow.set_tag("optuna.best_trial", str(trial.number))
            mlflow.log_metric("best_value", trial.value)
            best = {f"best.{k}": str(v)[:_MAX_PARAM_CHARS] for k, v in trial.params.items()}
            mlflow.log_params(best)
            example = mlflow_model.example_frame(dataset, model.getFeatureCols())
            mlflow_model.log_model(model, "model", input_example=example, code_paths=code_paths)
    except Exception as e:
        log.warning(
            "mlflow_logging: MLflow could not log the study's best model (%s: %s)",
            type(e).__name__,
            e,
        )


@contextlib.contextmanager
def trial_run(parent_run_id: str | None, trial_number: int, params: dict):
    """A run of its own for one trial, nested under ``parent_run_id``, active in this
    thread while the block runs (the trial's fit logs into it, ``log_fit``): tagged with the
    trial's number, its suggested params logged as ``trial.<name>``. Yields a function
    ``end(state, value)`` that records how the trial ended ("complete", "pruned" or
    "fail": the run then ends FAILED). Without a parent (MLflow failed) nothing is logged."""
    if parent_run_id is None:
        yield lambda state, value: None
        return
    import mlflow

    ended = {"state": "fail"}

    def end(state: str, value: float | None) -> None:
        ended["state"] = state
        try:
            mlflow.set_tag("optuna.trial_state", state)
            if value is not None:
                mlflow.log_metric("trial_value", value)
        except Exception as e:
            log.warning("mlflow_logging: could not log trial %d's end (%s)", trial_number, e)

    try:
        mlflow.start_run(
            run_name=f"trial-{trial_number}",
            nested=True,
            parent_run_id=parent_run_id,
            tags={"optuna.trial_number": str(trial_number)},
        )
        mlflow.log_params({f"trial.{k}": str(v)[:_MAX_PARAM_CHARS] for k, v in params.items()})
    except Exception as e:
        log.warning("mlflow_logging: could not start trial %d's run (%s)", trial_number, e)
        yield lambda state, value: None
        return
    try:
        yield end
    finally:
        mlflow.end_run("FAILED" if ended["state"] == "fail" else "FINISHED")
