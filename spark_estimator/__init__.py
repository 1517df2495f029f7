"""spark-estimator: distributed PyTorch training as a Spark ML stage.

    from spark_estimator import TorchEstimator, TorchModel, Store

Driver-side code lives in ``spark_estimator.driver`` (and the stage classes at the top
level); code that runs inside Spark tasks lives in ``spark_estimator.worker``.
"""

from .estimator import TorchEstimator
from .model import TorchModel
from .store import Store

__all__ = ["TorchEstimator", "TorchModel", "Store"]
__version__ = "0.1.0"
