"""Driver: TorchEstimator, the Spark ML Estimator that trains a torch model on a DataFrame.

``fit(df)`` runs four steps: validate every input (no Spark job yet) -> materialize the
selected columns to Parquet in the store (reused when already there) -> run one barrier
job of ``num_proc`` training tasks -> build a TorchModel from rank 0's result in the store.
"""

from __future__ import annotations

import functools
import time
import uuid

from pyspark import keyword_only
from pyspark.ml import Estimator
from pyspark.ml.util import MLReadable, MLWritable
from pyspark.sql import DataFrame

from .driver import validate
from .driver.launch import available_slots, run_barrier_job
from .driver.materialize import materialize
from .model import TorchModel
from .params import EstimatorParams
from .persistence import ObjectParamsReader, ObjectParamsWriter
from .serialization import loads, state_from_bytes
from .spec import TrainSpec
from .store import Store
from .worker.task import training_task


class TorchEstimator(Estimator, EstimatorParams, MLReadable, MLWritable):
    """Trains a ``torch.nn.Module`` on a Spark DataFrame with DistributedDataParallel.

    Each feature column becomes one positional argument of ``model.forward``; the loss is
    ``loss(output, label)`` summed over label columns (one model output per label column).
    ``loss`` should average over the batch (PyTorch's default ``reduction="mean"``).
    See ``explainParams()`` for every parameter.

    >>> est = TorchEstimator(model=net, optimizer=opt, loss=torch.nn.MSELoss(),
    ...                      feature_cols=["x"], label_cols=["y"], store=Store.create(path))
    >>> model = est.fit(df)   # a TorchModel
    """

    @keyword_only
    def __init__(
        self,
        *,
        model=None,
        optimizer=None,
        loss=None,
        feature_cols=None,
        label_cols=None,
        input_shapes=None,
        output_cols=None,
        batch_size=32,
        epochs=1,
        num_proc=None,
        validation=None,
        random_seed=0,
        store=None,
        use_gpu=True,
        run_id=None,
    ):
        super().__init__()
        self._set(**self._input_kwargs)

    def setParams(self, **params) -> TorchEstimator:
        """Set several params at once by name, e.g. ``setParams(epochs=5, batch_size=64)``."""
        return self._set(**params)

    # -- fit -----------------------------------------------------------------------------
    def _fit(self, dataset: DataFrame) -> TorchModel:
        spark = dataset.sparkSession
        features, labels, bundle, num_proc, store = self._validate(dataset)
        data = materialize(
            dataset, store, features, labels, self.getValidation(), self.getRandomSeed()
        )
        run_id = self.getRunId() or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
        spec = TrainSpec(
            bundle=bundle,
            data=data,
            store=store,
            run_id=run_id,
            batch_size=self.getBatchSize(),
            epochs=self.getEpochs(),
            seed=self.getRandomSeed(),
            use_gpu=self.getUseGpu(),
            input_shapes=self.getInputShapes(),
        )
        summaries = run_barrier_job(
            spark, num_proc, functools.partial(training_task, spec), f"spark-estimator {run_id}"
        )
        store.write_json(store.join("runs", run_id, "ranks.json"), summaries)
        digests = {s["weights_digest"] for s in summaries}
        if len(digests) != 1:
            raise RuntimeError(
                f"run {run_id}: ranks finished with different weights ({summaries}); "
                "the model is not the same on every rank"
            )
        result = state_from_bytes(store.read_bytes(store.result_path(run_id)))
        model, _, _ = loads(bundle)
        model.load_state_dict(result["model"])
        return TorchModel(
            model=model.cpu().eval(),
            feature_cols=self.getFeatureCols(),
            input_shapes=self.getInputShapes(),
            output_cols=self.getOutputCols(),
            history=result["history"],
            output_shapes=result["output_shapes"],
            run_id=run_id,
        )

    def _validate(self, dataset: DataFrame):
        """Check every input on the driver; return what fit needs. No Spark job runs here."""
        for name in ("model", "optimizer", "loss", "feature_cols", "label_cols", "store"):
            if not self.isDefined(name) or self.getOrDefault(name) is None:
                raise ValueError(f"{name}: is required")
        store = self.getStore()
        if not isinstance(store, Store):
            raise TypeError(f"store: expected a spark_estimator.Store, got {store!r}")
        schema = dataset.schema
        feature_cols, label_cols = self.getFeatureCols(), self.getLabelCols()
        features, labels = validate.check_columns(schema, feature_cols, label_cols)
        validate.check_validation(schema, self.getValidation(), feature_cols + label_cols)
        validate.check_input_shapes(self.getInputShapes(), feature_cols)
        validate.check_output_cols(self.getOutputCols(), [])
        validate.check_positive("batch_size", self.getBatchSize())
        validate.check_positive("epochs", self.getEpochs())
        slots = available_slots(dataset.sparkSession)
        num_proc = self.getNumProc() if self.getNumProc() is not None else slots
        validate.check_num_proc(num_proc, slots)
        bundle = validate.check_training_objects(
            self.getModel(), self.getOptimizer(), self.getLoss()
        )
        run_id = self.getRunId()
        if run_id is not None and store.exists(store.result_path(run_id)):
            raise ValueError(
                f"run_id: run '{run_id}' already finished in {store}; choose a new run_id"
            )
        return features, labels, bundle, num_proc, store

    # -- persistence ---------------------------------------------------------------------
    def write(self) -> ObjectParamsWriter:
        return ObjectParamsWriter(self)

    @classmethod
    def read(cls) -> ObjectParamsReader:
        return ObjectParamsReader(cls)

    def _objects(self) -> dict:
        # one pickle, so the optimizer still refers to the model's parameters when loaded
        return {
            name: self.getOrDefault(name)
            for name in ("model", "optimizer", "loss")
            if self.isDefined(name)
        }

    def _extra_metadata(self) -> dict:
        store = self.getStore()
        return {"store_url": store.url if store is not None else None}

    def _restore(self, objects: dict, metadata: dict) -> None:
        self._set(**objects)
        if metadata.get("store_url"):
            self._set(store=Store(metadata["store_url"]))
