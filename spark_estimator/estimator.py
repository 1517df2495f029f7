"""Driver: TorchEstimator, the Spark ML Estimator that trains a torch model on a DataFrame.

``fit(df)`` runs four steps: validate every input (no Spark job yet) -> materialize the
selected columns to Parquet in the store (reused when already there) -> run one barrier
job of ``num_proc`` training tasks -> build a TorchModel from rank 0's result in the store.
"""

from __future__ import annotations

import functools
import time
import uuid
import warnings
from typing import NamedTuple

from pyspark import keyword_only
from pyspark.ml import Estimator
from pyspark.ml.util import MLReadable, MLWritable
from pyspark.sql import DataFrame, SparkSession

from .driver import mlflow_log, run_manifest, validate, validate_training
from .driver.launch import available_slots, run_barrier_job
from .driver.materialize import COMPRESSIONS, WriteOptions, materialize
from .driver.monitor import FitMonitor
from .driver.parquet_dataset import parquet_dataset
from .failures import TrainingError, failure_path, read_failure
from .model import TorchModel
from .params import EstimatorParams
from .persistence import ObjectParamsReader, ObjectParamsWriter
from .serialization import loads, state_from_bytes
from .spec import (
    FLOAT_DTYPES,
    ColumnSpec,
    DatasetInfo,
    LoaderSpec,
    LoopSpec,
    TrainSpec,
    metric_keys,
)
from .store import Store
from .worker.task import training_task


class _Checked(NamedTuple):
    """What ``_validate`` hands to the rest of a fit."""

    features: list[ColumnSpec] | None  # None for fit_on_parquet: read from the Parquet
    labels: list[ColumnSpec] | None
    sample_weight: ColumnSpec | None
    bundle: bytes
    num_proc: int
    store: Store
    loader: LoaderSpec
    loop: LoopSpec
    manifest: dict  # what a resumed run must share with this fit (driver/run_manifest.py)


# the params whose objects the executors rebuild from one pickle (worker/objects.py)
_BUNDLED = (
    "model",
    "optimizer",
    "loss",
    "loss_constructors",
    "metrics",
    "lr_scheduler",
    "callbacks",
    "train_minibatch_fn",
)


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
        classification=False,
        probabilityCol="probability",
        rawPredictionCol="rawPrediction",
        learning_rate=None,
        batch_size=32,
        epochs=1,
        num_proc=None,
        validation=None,
        random_seed=0,
        store=None,
        use_gpu=True,
        run_id=None,
        partitions_per_process=4,
        row_group_size_mb=32.0,
        compression="snappy",
        dtype="float32",
        reader="arrow",
        shuffle=True,
        shuffle_buffer_size=None,
        reader_num_workers=2,
        inmemory_cache_all=False,
        train_steps_per_epoch=None,
        validation_steps_per_epoch=None,
        transformation_fn=None,
        lr_scaling="none",
        backward_passes_per_step=1,
        gradient_compression="none",
        mixed_precision="none",
        metrics=None,
        loss_weights=None,
        sample_weight_col=None,
        lr_scheduler=None,
        lr_scheduler_interval="epoch",
        callbacks=None,
        terminate_on_nan=True,
        train_minibatch_fn=None,
        loss_constructors=None,
        keep_checkpoints=None,
        collective_timeout=600.0,
        verbose=True,
        mlflow_logging=False,
    ):
        super().__init__()
        self._set(**self._input_kwargs)

    def setParams(self, **params) -> TorchEstimator:
        """Set several params at once by name, e.g. ``setParams(epochs=5, batch_size=64)``."""
        return self._set(**params)

    # -- fit -----------------------------------------------------------------------------
    def _fit(self, dataset: DataFrame) -> TorchModel:
        checked = self._validate(dataset.sparkSession, dataset)
        data = self._materialize(dataset, checked)
        return self._train(dataset.sparkSession, data, checked)

    def materialize(self, dataset: DataFrame) -> str:
        """Write ``dataset``'s selected columns to Parquet in the store (or find them there)
        and return the dataset folder, for ``fit_on_parquet``; the same as ``fit`` does first.
        """
        checked = self._validate(dataset.sparkSession, dataset)
        return self._materialize(dataset, checked).path

    def fit_on_parquet(
        self, path: str, validation_path: str | None = None, params: dict | None = None
    ) -> TorchModel:
        """Train on Parquet already in the store, without a DataFrame or materialization.

        ``path`` is a dataset folder returned by ``materialize`` (with the validation split
        made there), or a folder or file of Parquet rows, absolute in the store's filesystem
        or relative to its root; ``validation_path`` then optionally names validation rows
        (the ``validation`` param, which splits DataFrames, must be unset).
        Columns need numbers, lists of numbers or ML vector structs. ``params`` overrides
        this estimator's params for this call, as in ``fit``.
        """
        if params:
            return self.copy(params).fit_on_parquet(path, validation_path)
        spark = SparkSession.active()
        checked = self._validate(spark, None)
        data = parquet_dataset(
            checked.store,
            path,
            validation_path,
            self.getFeatureCols(),
            self.getLabelCols(),
            self.getDtype(),
            self.getValidation(),
            self.getSampleWeightCol(),
            self.getInputShapes(),
        )
        self._check_callbacks(has_validation=data.rows("validation") > 0)
        return self._train(spark, data, checked)

    def _materialize(self, dataset: DataFrame, checked: _Checked) -> DatasetInfo:
        options = WriteOptions(
            num_files=self.getPartitionsPerProcess() * checked.num_proc,
            row_group_bytes=int(self.getRowGroupSizeMb() * 2**20),
            compression=self.getCompression(),
        )
        return materialize(
            dataset,
            checked.store,
            checked.features,
            checked.labels,
            self.getValidation(),
            self.getRandomSeed(),
            options,
            checked.sample_weight,
            self.getInputShapes(),
        )

    def _train(self, spark, data: DatasetInfo, checked: _Checked) -> TorchModel:
        store = checked.store
        run_id = self.getRunId() or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
        manifest = {**checked.manifest, **run_manifest.data_fields(data)}
        run_manifest.check_resume(store, run_id, manifest, self.getEpochs())
        run_manifest.write_manifest(store, run_id, manifest)
        spec = TrainSpec(
            bundle=checked.bundle,
            data=data,
            store=store,
            run_id=run_id,
            batch_size=self.getBatchSize(),
            epochs=self.getEpochs(),
            seed=self.getRandomSeed(),
            use_gpu=self.getUseGpu(),
            input_shapes=self.getInputShapes(),
            loader=checked.loader,
            loop=checked.loop,
            collective_timeout=self.getCollectiveTimeout(),
            launch_id=uuid.uuid4().hex,
        )
        summaries = self._launch(spark, spec, checked.num_proc)
        store.write_json(store.join("runs", run_id, "ranks.json"), summaries)
        digests = {s["weights_digest"] for s in summaries}
        if len(digests) != 1:
            raise RuntimeError(
                f"run {run_id}: ranks finished with different weights ({summaries}); "
                "the model is not the same on every rank"
            )
        notes = sorted({s["device_note"] for s in summaries if s.get("device_note")})
        for note in notes:
            warnings.warn(f"spark-estimator: {note}", RuntimeWarning, stacklevel=3)
        result = state_from_bytes(store.read_bytes(store.result_path(run_id)))
        model = loads(checked.bundle)["model"]
        model.load_state_dict(result["model"])
        fitted = TorchModel(
            model=model.cpu().eval(),
            feature_cols=self.getFeatureCols(),
            input_shapes=self.getInputShapes(),
            output_cols=self.getOutputCols(),
            classification=self.getClassification(),
            probabilityCol=self.getProbabilityCol(),
            rawPredictionCol=self.getRawPredictionCol(),
            history=result["history"],
            output_shapes=result["output_shapes"],
            run_id=run_id,
            training_summary=result["summary"],
        )
        if self.getMlflowLogging():
            mlflow_log.log_fit(self, fitted)
        return fitted

    def _launch(self, spark: SparkSession, spec: TrainSpec, num_proc: int) -> list[dict]:
        """Run the training job (retried by Spark after a lost task, resuming from the last
        checkpoint), following it from the driver (driver/monitor.py); raise the training
        code's own error as a TrainingError, with the failing rank's last output lines."""
        store, run_id = spec.store, spec.run_id
        failure = failure_path(store, run_id, spec.launch_id)
        monitor = FitMonitor(store, run_id, spec.launch_id, self.getVerbose())
        try:
            with monitor:
                summaries = run_barrier_job(
                    spark,
                    num_proc,
                    functools.partial(training_task, spec),
                    f"spark-estimator {run_id}",
                    retry=True,
                )
        except Exception as e:
            if (record := read_failure(failure, store)) is not None:
                raise TrainingError(run_id, record, monitor.tail(record["rank"])) from e
            if hasattr(e, "add_note") and monitor.tail():
                e.add_note(f"last output of the ranks of run '{run_id}':\n{monitor.tail()}")
            raise
        if any(s.get("aborted") for s in summaries):
            record = read_failure(failure, store)
            raise TrainingError(run_id, record, monitor.tail(record["rank"]))
        return summaries

    def _validate(self, spark: SparkSession, dataset: DataFrame | None) -> _Checked:
        """Check every input on the driver; return what fit needs. No Spark job runs here.

        Without a DataFrame (fit_on_parquet) the columns are checked against the Parquet.
        """
        for name in ("model", "optimizer", "feature_cols", "label_cols", "store"):
            if not self.isDefined(name) or self.getOrDefault(name) is None:
                raise ValueError(f"{name}: is required")
        store = self.getStore()
        if not isinstance(store, Store):
            # the type only: the value may be a dict of credentials
            raise TypeError(f"store: expected a spark_estimator.Store, got {type(store).__name__}")
        feature_cols, label_cols = self.getFeatureCols(), self.getLabelCols()
        validate.check_choice("dtype", self.getDtype(), FLOAT_DTYPES)
        features = labels = schema = None
        if dataset is not None:
            schema = dataset.schema
            features, labels = validate.check_columns(
                schema, feature_cols, label_cols, self.getDtype()
            )
            validate.check_validation(schema, self.getValidation(), feature_cols + label_cols)
        else:
            validate.check_column_names(feature_cols, label_cols)
        sample_weight = validate.check_sample_weight_col(
            schema, self.getSampleWeightCol(), feature_cols + label_cols, self.getDtype()
        )
        validate.check_input_shapes(self.getInputShapes(), feature_cols)
        validate.check_output_cols(self.getOutputCols(), [])
        if self.getClassification():
            validate.classification_cols(
                self.getOutputCols(),
                self.getProbabilityCol(),
                self.getRawPredictionCol(),
                label_cols,
            )
        for name in (
            "batch_size",
            "epochs",
            "partitions_per_process",
            "reader_num_workers",
            "row_group_size_mb",
            "collective_timeout",
        ):
            validate.check_positive(name, self.getOrDefault(name))
        for name in ("shuffle_buffer_size", "train_steps_per_epoch", "validation_steps_per_epoch"):
            validate.check_positive(name, self.getOrDefault(name), optional=True)
        loop = self._loop_spec()
        validate.check_choice("compression", self.getCompression(), COMPRESSIONS)
        validate.check_reader(self.getReader())
        transformation_fn = validate.check_transformation_fn(self.getTransformationFn())
        validate.check_no_dynamic_allocation(spark)
        if self.getMlflowLogging():
            mlflow_log.check_installed()
        slots = available_slots(spark, self.getNumProc())
        num_proc = self.getNumProc() if self.getNumProc() is not None else slots
        validate.check_num_proc(num_proc, slots)
        objects = {name: self.getOrDefault(name) for name in _BUNDLED}
        objects["optimizer"] = validate_training.with_learning_rate(
            objects["optimizer"], self.getLearningRate()
        )
        bundle = validate_training.training_bundle(objects, label_cols)
        if dataset is not None:
            self._check_callbacks(has_validation=self.getValidation() is not None)
        manifest = self._check_run_id(store, num_proc, objects["optimizer"])
        loader = LoaderSpec(
            reader=self.getReader(),
            shuffle=self.getShuffle(),
            shuffle_buffer_size=self.getShuffleBufferSize(),
            num_workers=self.getReaderNumWorkers(),
            inmemory_cache_all=self.getInmemoryCacheAll(),
            train_steps_per_epoch=self.getTrainStepsPerEpoch(),
            validation_steps_per_epoch=self.getValidationStepsPerEpoch(),
            transformation_fn=transformation_fn,
        )
        return _Checked(
            features, labels, sample_weight, bundle, num_proc, store, loader, loop, manifest
        )

    def _check_run_id(self, store: Store, num_proc: int, optimizer) -> dict:
        """The manifest of what this fit's checkpoints depend on (but the data), with the
        optimizer it trains (``learning_rate`` applied); refuses a ``run_id`` that finished,
        or whose checkpoints this fit cannot resume."""
        manifest = run_manifest.run_manifest(
            self.getModel(),
            optimizer,
            {
                "learning_rate": self.getLearningRate(),
                "num_proc": num_proc,
                "batch_size": self.getBatchSize(),
                "random_seed": self.getRandomSeed(),
                "backward_passes_per_step": self.getBackwardPassesPerStep(),
                "train_steps_per_epoch": self.getTrainStepsPerEpoch(),
            },
        )
        run_id = self.getRunId()
        if run_id is not None:
            if store.exists(store.result_path(run_id)):
                raise ValueError(
                    f"run_id: run '{run_id}' already finished in {store}; choose a new run_id"
                )
            run_manifest.check_resume(store, run_id, manifest, self.getEpochs())
        return manifest

    def _loop_spec(self) -> LoopSpec:
        weights = self.getLossWeights()
        loop = LoopSpec(
            lr_scaling=self.getLrScaling(),
            backward_passes_per_step=self.getBackwardPassesPerStep(),
            gradient_compression=self.getGradientCompression(),
            mixed_precision=self.getMixedPrecision(),
            loss_weights=tuple(weights) if weights else None,
            lr_scheduler_interval=self.getLrSchedulerInterval(),
            terminate_on_nan=self.getTerminateOnNan(),
            keep_checkpoints=self.getKeepCheckpoints(),
        )
        validate_training.check_loop(loop, self.getLabelCols(), self.getTrainMinibatchFn())
        return loop

    def _check_callbacks(self, has_validation: bool) -> None:
        metrics = validate_training.check_metrics(self.getMetrics()) or {}
        names = ["loss", *metric_keys(list(metrics), self.getLabelCols())]
        splits = ("train", "validation") if has_validation else ("train",)
        monitorable = {f"{split}.{name}" for split in splits for name in names}
        validate_training.check_callbacks(self.getCallbacks(), monitorable)

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
            for name in (*_BUNDLED, "transformation_fn")
            if self.isDefined(name)
        }

    def _extra_metadata(self) -> dict:
        store = self.getStore()
        return {"store_url": store.url if store is not None else None}

    def _restore(self, objects: dict, metadata: dict) -> None:
        self._set(**objects)
        if metadata.get("store_url"):
            self._set(store=Store(metadata["store_url"]))
