"""spark-estimator: distributed PyTorch training as a Spark ML stage.

    from spark_estimator import TorchEstimator, TorchModel, Store   # the Spark ML stages
    from spark_estimator import LightningEstimator                  # LightningModules
    from spark_estimator import run, distributed                   # hand-written loops
    from spark_estimator import TrainingError                      # a rank's own error
    from spark_estimator.tuning import OptunaSearch                # Optuna studies of fits

Driver-side code lives in ``spark_estimator.driver`` (and the stage classes at the top
level); code that runs inside Spark tasks lives in ``spark_estimator.worker``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = [
    "TorchEstimator",
    "LightningEstimator",
    "TorchModel",
    "Store",
    "TrainingError",
    "run",
    "distributed",
]
__version__ = "0.1.0"

# Imported on first use: Spark's Python workers unpickle functions of this package (the
# materialization writer, for one) and should not pay for importing torch and pyspark.ml.
_WHERE = {
    "TorchEstimator": ".estimator",
    "LightningEstimator": ".lightning_estimator",
    "TorchModel": ".model",
    "Store": ".store",
    "TrainingError": ".shared.failures",
    "run": ".runner",
    "distributed": ".distributed",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'spark_estimator' has no attribute {name!r}")
    module = importlib.import_module(_WHERE[name], __name__)
    value = module if name == "distributed" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:
    from . import distributed
    from .estimator import TorchEstimator
    from .lightning_estimator import LightningEstimator
    from .model import TorchModel
    from .runner import run
    from .shared.failures import TrainingError
    from .store import Store
