"""spark-estimator: distributed PyTorch training as a Spark ML stage.

    from spark_estimator import TorchEstimator, TorchModel, Store   # the Spark ML stages
    from spark_estimator import run, distributed                   # hand-written loops
    from spark_estimator import TrainingError                      # a rank's own error

Driver-side code lives in ``spark_estimator.driver`` (and the stage classes at the top
level); code that runs inside Spark tasks lives in ``spark_estimator.worker``.
"""

from .estimator import TorchEstimator
from .failures import TrainingError
from .model import TorchModel
from .runner import run
from .store import Store
from .worker import distributed

__all__ = ["TorchEstimator", "TorchModel", "Store", "TrainingError", "run", "distributed"]
__version__ = "0.1.0"
