"""A fitted TorchModel as an MLflow Model: logged, registered, served, scored anywhere.

    import spark_estimator.mlflow
    info = spark_estimator.mlflow.log_model(model, "model", input_example=df,
                                            registered_model_name="churn")
    mlflow.pyfunc.load_model(info.model_uri).predict(pandas_df)     # what transform appends
    mlflow.pyfunc.spark_udf(spark, info.model_uri)                  # in any Spark job
    mlflow models serve -m models:/churn/1 --env-manager local      # REST: /invocations

The logged folder is the TorchModel's Spark ML stage with MLflow's files beside it, so
``TorchModel.load`` reads it too (``load_model``). Its ``python_function`` flavor is
``spark_estimator.pyfunc.TorchPyfunc``; what ``predict`` takes and returns, and how the
folder is laid out: docs/serving.md. Needs MLflow 3: the ``mlflow`` extra (mlflow-skinny)
logs and loads; ``mlflow models serve`` needs the ``serving`` extra (mlflow).

Loading runs code: the stage's ``objects.pkl`` is a pickle (docs/security.md); the weights
alone load with ``torch.load(weights_only=True)`` from ``weights.pt`` in the folder.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .driver import mlflow_model

if TYPE_CHECKING:
    import pandas as pd
    from mlflow.models import ModelInfo, ModelSignature
    from pyspark.sql import DataFrame

    from .model import TorchModel
    from .pyfunc import TorchPyfunc

__all__ = ["log_model", "save_model", "load_model"]


def log_model(
    model: Any,
    name: str = "model",
    *,
    input_example: pd.DataFrame | DataFrame | None = None,
    signature: ModelSignature | None = None,
    registered_model_name: str | None = None,
    pip_requirements: list[str] | None = None,
    extra_pip_requirements: list[str] | None = None,
    pytorch_flavor: bool = False,
    metadata: dict | None = None,
    code_paths: list[str] | None = None,
) -> ModelInfo:
    """Log a fitted TorchModel as an MLflow Model of the active run (a new run when none
    is active), as ``mlflow.<flavor>.log_model`` does.

    Parameters
    ----------
    model : TorchModel
        The fitted model, or a tuning result holding one as its ``bestModel``
        (``CrossValidatorModel``, ``TrainValidationSplitModel``).
    name : str, default "model"
        The logged model's name: ``runs:/<run_id>/<name>`` finds it.
    input_example : pandas.DataFrame or pyspark.sql.DataFrame, optional
        Rows holding the feature columns; the first 2 are kept (ML vectors as arrays) as
        the model's input example, and give the signature's input types when the model
        does not record the fit's columns (a TorchModel built by hand).
    signature : mlflow.models.ModelSignature, optional
        Replaces the one inferred: the fit's feature columns (or the example's) as
        inputs, the columns ``transform`` appends as outputs. The inferred inputs are
        tensors of shape (-1, width) and (-1,) where every feature column is an array, an
        ML vector or a number, not all numbers, and each width is known (the fit's, else
        ``input_shapes``' or the example's), which MLflow checks a column at once; else
        columns (docs/serving.md).
    registered_model_name : str, optional
        Register the logged model under this name (created when it does not exist): a
        new version, loadable as ``models:/<name>/<version>``.
    pip_requirements : list of str, optional
        Replaces the requirements written (this package, torch, pyspark, pandas,
        pyarrow, numpy, cloudpickle and fsspec at the versions installed here; Pillow
        and simplejpeg where the features hold images).
    extra_pip_requirements : list of str, optional
        Added to them: what a ``decode_fn`` imports (e.g. ``["tokenizers==0.20.3"]``).
    pytorch_flavor : bool, default False
        Also write MLflow's ``pytorch`` flavor, so that ``mlflow.pytorch.load_model``
        gives the module back: a pickle of the whole module, a second copy of the
        weights (see docs/serving.md for why it is off by default).
    metadata : dict, optional
        Custom metadata in the MLmodel file.
    code_paths : list of str, optional
        Files and folders of your own code copied into the model's ``code/`` folder, which
        MLflow puts first on ``sys.path`` before it loads the model (as
        ``mlflow.pyfunc.log_model``'s): what a loading process must import and does not
        find by itself. The modules that define the model's classes and functions (the
        module, ``decode_fn``, ``collate_fn``, the loss...) are shipped without it where
        they are your own, not an installed package: read from the saved pickle, with the
        modules they import (docs/serving.md, "Your own code").

    Returns
    -------
    mlflow.models.model.ModelInfo
        ``model_uri`` (``models:/<model_id>``), ``signature``, ``registered_model_version``.

    Raises
    ------
    TypeError, ValueError
        ``model`` holds no TorchModel; ``input_example`` lacks a feature column;
        ``pip_requirements`` and ``extra_pip_requirements`` both given; a path of
        ``code_paths`` does not exist, or two have one name.

    Examples
    --------
    >>> with mlflow.start_run():                                        # doctest: +SKIP
    ...     info = log_model(model, input_example=df, registered_model_name="churn")
    >>> mlflow.pyfunc.load_model("models:/churn/1").predict(pdf)        # doctest: +SKIP
    """
    return mlflow_model.log_model(
        model,
        name,
        registered_model_name=registered_model_name,
        input_example=input_example,
        signature=signature,
        pip_requirements=pip_requirements,
        extra_pip_requirements=extra_pip_requirements,
        pytorch_flavor=pytorch_flavor,
        metadata=metadata,
        code_paths=code_paths,
    )


def save_model(
    model: Any,
    path: str,
    *,
    input_example: pd.DataFrame | DataFrame | None = None,
    signature: ModelSignature | None = None,
    pip_requirements: list[str] | None = None,
    extra_pip_requirements: list[str] | None = None,
    pytorch_flavor: bool = False,
    metadata: dict | None = None,
    code_paths: list[str] | None = None,
) -> None:
    """Write a fitted TorchModel as an MLflow Model in the local folder ``path`` (which
    must not exist or be empty), without a tracking server: ``log_model``'s folder.

    Parameters
    ----------
    model : TorchModel
        The fitted model, or a tuning result holding one as its ``bestModel``.
    path : str
        A local folder.
    input_example, signature, pip_requirements, extra_pip_requirements, pytorch_flavor
        As ``log_model``'s.
    metadata, code_paths
        As ``log_model``'s.

    Raises
    ------
    TypeError, ValueError
        As ``log_model``'s.
    mlflow.exceptions.MlflowException
        ``path`` exists and is not empty.

    Examples
    --------
    >>> save_model(model, "/tmp/churn")                                 # doctest: +SKIP
    >>> mlflow.pyfunc.load_model("/tmp/churn").predict(pdf)             # doctest: +SKIP
    """
    mlflow_model.save_model(
        path,
        torch_model=mlflow_model.torch_model_of(model),
        input_example=input_example,
        signature=signature,
        pip_requirements=pip_requirements,
        extra_pip_requirements=extra_pip_requirements,
        pytorch_flavor=pytorch_flavor,
        metadata=metadata,
        code_paths=code_paths,
    )


def load_model(model_uri: str, dst_path: str | None = None) -> TorchModel:
    """The TorchModel of an MLflow Model this module logged or saved (or a folder that
    ``mlflow_logging`` logged before the model was an MLflow Model), for ``transform`` in
    Spark or ``getModel()``, the trained ``nn.Module``. Unpickles ``objects.pkl``: load only
    what you trust (docs/security.md).

    Parameters
    ----------
    model_uri : str
        ``runs:/<run_id>/model``, ``models:/<name>/<version>``, ``models:/<model_id>``, a
        local folder or any URI ``mlflow.artifacts.download_artifacts`` takes.
    dst_path : str, optional
        Where to download it (a temporary folder by default).

    Returns
    -------
    TorchModel
        The fitted model, as ``TorchModel.load`` reads the downloaded folder, after the
        model's ``code/`` folder (``code_paths``, your own modules) is put first on
        ``sys.path``, as ``mlflow.pyfunc.load_model`` puts it.

    Examples
    --------
    >>> net = load_model("models:/churn/1").getModel()                  # doctest: +SKIP
    """
    import mlflow

    from .model import TorchModel

    path = mlflow.artifacts.download_artifacts(model_uri, dst_path=dst_path)
    mlflow_model.add_code_to_path(path)
    return TorchModel.load(path)


def _load_pyfunc(path: str, model_config: dict | None = None) -> TorchPyfunc:
    """MLflow's hook (``loader_module``): the python_function of the model in ``path``."""
    if model_config:
        raise ValueError(
            f"model_config: a spark-estimator model takes none (given: {sorted(model_config)})"
        )
    from .model import TorchModel
    from .pyfunc import TorchPyfunc

    return TorchPyfunc(TorchModel.load(path))
