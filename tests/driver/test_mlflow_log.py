"""mlflow_log: params, per-epoch metrics and the model (an MLflow Model) reach a real MLflow
store."""

import pytest
import torch

from spark_estimator import Store, TorchEstimator, TorchModel
from spark_estimator.driver import mlflow_log
from tests.conftest import make_estimator

mlflow = pytest.importorskip("mlflow")

HISTORY = [
    {"epoch": 1, "lr": [0.1], "train": {"loss": 2.0}, "validation": {"loss": 2.5}},
    {"epoch": 2, "lr": [0.1], "train": {"loss": 1.0}, "validation": {"loss": 1.5}},
]


def estimator(tmp_path):
    net = torch.nn.Linear(3, 1)
    return TorchEstimator(
        model=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["y"],
        epochs=2,
        metrics={"mae": torch.nn.functional.l1_loss},
        store=Store(str(tmp_path / "store")),
        mlflow_logging=True,
    )


def fitted_model():
    return TorchModel(
        model=torch.nn.Linear(3, 1), feature_cols=["x"], history=HISTORY, run_id="run-7"
    )


def test_params_are_strings_with_defaults_class_names_and_the_store_url(tmp_path):
    params = mlflow_log.logged_params(estimator(tmp_path), "run-7")
    assert params["run_id"] == "run-7"
    assert params["epochs"] == "2" and params["batch_size"] == "32"  # set, and a default
    assert params["model"] == "Linear" and params["optimizer"] == "SGD"
    assert params["metrics"] == "mae"
    assert params["store"] == str(tmp_path / "store")
    assert "run_id" in params and "num_proc" not in params  # None values are left out


def test_a_new_run_gets_params_metrics_per_epoch_and_the_model(tmp_path, mlflow_tracking, spark):
    run_id = mlflow_log.log_fit(estimator(tmp_path), fitted_model())
    run = mlflow_tracking.get_run(run_id)
    assert run.info.run_name == "run-7" and run.info.status == "FINISHED"
    assert run.data.params["optimizer"] == "SGD"
    history = mlflow_tracking.get_metric_history(run_id, "validation/loss")
    assert [(m.step, m.value) for m in history] == [(1, 2.5), (2, 1.5)]
    info = mlflow.models.get_model_info(f"runs:/{run_id}/model")  # an MLflow Model
    assert set(info.flavors) == {"python_function", "spark_estimator"}
    folder = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="model")
    loaded = TorchModel.load(folder)  # the Spark ML stage beside MLmodel
    assert loaded.getHistory() == HISTORY
    for a, b in zip(loaded.getModel().parameters(), fitted_model().getModel().parameters()):
        assert a.shape == b.shape


def test_an_active_run_is_used_and_left_open(tmp_path, mlflow_tracking, spark):
    with mlflow.start_run(run_name="mine") as active:
        run_id = mlflow_log.log_fit(estimator(tmp_path), fitted_model())
        assert run_id == active.info.run_id
        assert mlflow.active_run().info.run_id == run_id
    assert mlflow_tracking.get_run(run_id).data.metrics["train/loss"] == 1.0


def test_missing_mlflow_is_reported_naming_the_param(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "mlflow", None)
    with pytest.raises(ValueError, match="mlflow_logging: MLflow is not installed"):
        mlflow_log.check_installed()


def test_mlflow_before_3_is_reported_naming_the_param(monkeypatch):
    monkeypatch.setattr(mlflow, "__version__", "2.22.1")
    with pytest.raises(ValueError, match="mlflow_logging: MLflow 2.22.1 is installed; .* 3"):
        mlflow_log.check_installed()


def test_an_mlflow_failure_is_a_warning_and_the_fit_returns_its_model(
    tmp_path, mlflow_tracking, regression_df, caplog
):
    """Two fits inside one active run (as a CrossValidator does): MLflow refuses to change
    a logged param's value, so the second fit's logging fails; its model is returned."""
    store = Store.create(str(tmp_path / "store"))
    with mlflow.start_run() as active:
        first = make_estimator(store=store, epochs=1, batch_size=16, mlflow_logging=True)
        first.fit(regression_df)
        with caplog.at_level("WARNING", logger="spark_estimator.driver.mlflow_log"):
            second = make_estimator(store=store, epochs=1, batch_size=32, mlflow_logging=True)
            model = second.fit(regression_df)
    assert isinstance(model, TorchModel) and model.getHistory()
    assert store.exists(store.run(model.getRunId()).result)
    [record] = [r for r in caplog.records if r.name == "spark_estimator.driver.mlflow_log"]
    assert record.levelname == "WARNING" and "MlflowException" in record.getMessage()
    assert "Changing param values is not allowed" in record.getMessage()
    assert model.getRunId() in record.getMessage()
    logged = mlflow_tracking.get_run(active.info.run_id).data.params
    assert logged["batch_size"] == "16"  # the first fit's record stays as it was
