"""Driver: what a fit checks before any Spark job, and what it hands to the rest of the
fit: every param on its value, the columns against the schema, the decoding params, the
processes and slots, the run to resume (``FitChecks``, the estimators' part that does it;
``Checked``, its result). Each check raises naming the param or column at fault."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

from pyspark.sql import DataFrame, SparkSession

from ..shared.spec import FLOAT_DTYPES, ColumnSpec, DatasetInfo, DecodeSpec, LoaderSpec, LoopSpec
from ..store import Store
from . import mlflow_log, run_manifest, validate
from .in_place import DATA_COPIES
from .launch import available_slots
from .materialize import COMPRESSIONS
from .monitor import show_fit_line
from .stage_profile import TaskProfile, task_profile
from .task_python import check_task_python, local_python

# a fit's lines (its first, on the learning rates), on the fit's logger, as docs name it
logger = logging.getLogger("spark_estimator.driver.fit")


class Training(NamedTuple):
    """What a subclass's ``_training`` answers: what the executors train with, and the
    checks that wait for the data."""

    bundle: bytes  # the one cloudpickle the executors rebuild the objects from
    loop: LoopSpec | None  # our loop's parameters; None for Lightning (its Trainer's own)
    manifest: dict  # what checkpoints depend on besides the data (run_manifest)
    # checks the callbacks, given whether the fit has validation data
    check_callbacks: Callable[[bool], None]
    # (features, labels, sample_weight, *, row_lengths, transformation_fn, label_ranges) ->
    # False when the columns' shapes are not known yet (loss_probe.check_loss); None: no loss
    # to probe
    probe_loss: Callable[..., bool] | None = None
    # the line a fit logs first (TorchEstimator: the learning rate each rank uses, and why)
    first_log: str | None = None


class Checked(NamedTuple):
    """What ``_validate`` hands to the rest of a fit."""

    features: list[ColumnSpec] | None  # None for fit_on_parquet: read from the Parquet
    labels: list[ColumnSpec] | None
    sample_weight: ColumnSpec | None
    training: Training
    num_proc: int  # the processes asked for (num_proc, or every slot)
    start_procs: int  # the processes the first launch has: fewer when elastic and short
    store: Store
    loader: LoaderSpec
    probed: bool  # whether the loss was tried on a probe batch (else: once the data is known)
    use_gpu: bool | str  # what the tasks are told (validate.tasks_use_gpu)
    stage: TaskProfile  # the training job's task resources (stage-level scheduling)


_positive = validate.check_positive
_optional_positive = functools.partial(validate.check_positive, optional=True)
# the params checked on their value alone, in this order: param -> check(param, value)
_PARAM_CHECKS: dict[str, Callable[[str, object], None]] = {
    "dtype": functools.partial(validate.check_choice, choices=FLOAT_DTYPES),
    "batch_size": _positive,
    "epochs": _positive,
    "partitions_per_process": _positive,
    "reader_num_workers": _positive,
    "row_group_size_mb": _positive,
    "collective_timeout": _positive,
    "min_num_proc": _optional_positive,
    "max_restarts": validate.check_non_negative,
    "elastic_timeout": _positive,
    "shuffle_buffer_size": _optional_positive,
    "train_steps_per_epoch": _optional_positive,
    "validation_steps_per_epoch": _optional_positive,
    "keep_checkpoints": _optional_positive,
    "compression": functools.partial(validate.check_choice, choices=COMPRESSIONS),
    "reader": validate.check_reader,
    "data_copy": functools.partial(validate.check_choice, choices=DATA_COPIES),
    "device_cache_fraction": validate.check_fraction,
}


def check_bucketing_data(data: DatasetInfo, shuffle: bool) -> None:
    """``bucket_by_length`` once the data is known: refused without a string or array
    column (``fit_on_parquet``, whose columns were not known before); a warning where no
    column's rows differ in length, since there is nothing to group then."""
    columns = data.features + data.labels
    validate.check_bucketing(True, columns, shuffle)
    if not any(c.kind in ("sequence", "string") for c in columns):
        logger.warning(
            "bucket_by_length: every array column's rows have one length (%s), so rows "
            "keep their shuffled order",
            ", ".join(f"'{c.name}'" for c in columns if c.kind == "array"),
        )


def vector_sizes(schema) -> dict[str, int]:
    """The length of each vector column whose ML attributes record it (the output of
    ``VectorAssembler``, ``StandardScaler``, ``OneHotEncoder``...): known without a job."""
    sizes = {}
    for field in schema.fields:
        size = (field.metadata or {}).get("ml_attr", {}).get("num_attrs")
        if isinstance(size, int) and size > 0:
            sizes[field.name] = size
    return sizes


class FitChecks:
    """The estimators' checks before any job (a mixin of ``StoreEstimator``: its params,
    ``_training`` and ``_REQUIRED``)."""

    # whether the trainer takes a label column of strings as it is (a LightningModule may;
    # TorchEstimator's loss cannot, so it needs a decode_fn that maps them)
    _STRING_LABELS = True

    def _check_columns(
        self, dataset: DataFrame | None
    ) -> tuple[list[ColumnSpec] | None, list[ColumnSpec] | None, ColumnSpec | None]:
        """The feature, label and sample weight columns' specs, checked against the
        DataFrame's schema; without one (fit_on_parquet) only their names (specs None)."""
        feature_cols, label_cols = self.getFeatureCols(), self.getLabelCols()
        features = labels = schema = None
        if dataset is not None:
            schema = dataset.schema
            features, labels = validate.check_columns(
                schema, feature_cols, label_cols, self.getDtype()
            )
            labels = [
                validate.as_class_indices(spec) if classes else spec
                for spec, classes in zip(labels, self._class_index_labels())
            ]
            validate.check_validation(schema, self.getValidation(), feature_cols + label_cols)
        else:
            validate.check_column_names(feature_cols, label_cols)
        sample_weight = validate.check_sample_weight_col(
            schema, self._sample_weight_col(), feature_cols + label_cols, self.getDtype()
        )
        validate.check_input_shapes(self.getInputShapes(), feature_cols, features)
        validate.check_output_cols(self.getOutputCols(), [])
        if self.getClassification():
            validate.classification_cols(
                self.getOutputCols(),
                self.getProbabilityCol(),
                self.getRawPredictionCol(),
                label_cols,
            )
        return features, labels, sample_weight

    def _validate(
        self, spark: SparkSession, dataset: DataFrame | None, log_first: bool = True
    ) -> Checked:
        """Check every input on the driver; return what fit needs. No Spark job runs here,
        but on a cluster the one task that checks the tasks' Python (``task_python``).
        A fit's first log line (``Training.first_log``) comes from here, unless
        ``log_first`` is False (``materialize`` alone trains nothing).

        Without a DataFrame (fit_on_parquet) the columns are checked against the Parquet,
        and the callbacks once it is known whether it has validation rows.
        """
        for name in self._REQUIRED:
            if not self.isDefined(name) or self.getOrDefault(name) is None:
                raise ValueError(f"{name}: is required")
        store = self.getStore()
        if not isinstance(store, Store):
            # the type only: the value may be a dict of credentials
            raise TypeError(f"store: expected a spark_estimator.Store, got {type(store).__name__}")
        for name, check in _PARAM_CHECKS.items():
            check(name, self.getOrDefault(name))
        features, labels, sample_weight = self._check_columns(dataset)
        decode = self._decode_spec(features, labels)
        transformation_fn = validate.check_transformation_fn(self.getTransformationFn())
        validate.check_no_dynamic_allocation(spark)
        stage = task_profile(spark, self.getStageLevelScheduling(), self.getUseGpu())
        use_gpu = validate.check_use_gpu(spark, self.getUseGpu(), stage)
        validate.check_decode_device(
            decode.device,
            use_gpu,
            "use_gpu=False trains on the CPU"
            if self.getUseGpu() is False
            else "this fit trains on the CPU: Spark gives its tasks no GPU "
            f"({' and '.join(validate.GPU_AMOUNTS)} are not set)",
            local_python(spark),
        )
        if self.getMlflowLogging():
            mlflow_log.check_installed()
        mlflow_log.check_code_paths(self.getMlflowLogging(), self.getMlflowCodePaths())
        slots = available_slots(spark, self.getNumProc(), profile=stage.profile)
        num_proc = self.getNumProc() if self.getNumProc() is not None else slots
        if self.getMinNumProc() is None:
            validate.check_num_proc(num_proc, slots, slots_of=stage.slots_note())
        start_procs = validate.check_min_num_proc(
            self.getMinNumProc(), num_proc, slots, stage.slots_note()
        )
        training = self._training(num_proc)
        if training.first_log and log_first:
            # printed too where lr_scaling changes the rates: the Horovod user's safeguard
            scaled = training.loop is not None and training.loop.lr_scaling == "linear"
            show_fit_line(logger, training.first_log, self.getVerbose() and scaled and num_proc > 1)
        if dataset is not None:
            training.check_callbacks(self.getValidation() is not None)
        self._check_run_id(store, training.manifest)
        loader = LoaderSpec(
            reader=self.getReader(),
            shuffle=self.getShuffle(),
            shuffle_buffer_size=self.getShuffleBufferSize(),
            num_workers=self.getReaderNumWorkers(),
            inmemory_cache_all=self.getInmemoryCacheAll(),
            device_cache_fraction=self.getDeviceCacheFraction(),
            train_steps_per_epoch=self.getTrainStepsPerEpoch(),
            validation_steps_per_epoch=self.getValidationStepsPerEpoch(),
            transformation_fn=transformation_fn,
            decode=decode,
        )
        check_task_python(spark)
        probed = training.probe_loss is None or (
            features is not None
            and training.probe_loss(
                features,
                labels,
                sample_weight,
                row_lengths=vector_sizes(dataset.schema),
                transformation_fn=transformation_fn,
            )
        )
        return Checked(
            features=features,
            labels=labels,
            sample_weight=sample_weight,
            training=training,
            num_proc=num_proc,
            start_procs=start_procs,
            store=store,
            loader=loader,
            probed=probed,
            use_gpu=use_gpu,
            stage=stage,
        )

    def _decode_spec(self, features, labels) -> DecodeSpec:
        """The decoding params, checked with the columns they apply to (``validate``)."""
        columns = None if features is None else features + labels
        validate.check_bucketing(self.getBucketByLength(), columns, self.getShuffle())
        return validate.decode_spec(
            self,
            features,
            labels,
            self.getReader(),
            self.getBadRows(),
            self.getBucketByLength(),
            self._STRING_LABELS,
        )

    def _check_run_id(self, store: Store, manifest: dict) -> None:
        """A given ``run_id``'s checkpoints (if any) can be resumed with this fit's training
        manifest; a finished run is trained further (Horovod's way: the same ``run_id``, more
        ``epochs``) from its last epoch checkpoint. The data is checked once known
        (``_train``)."""
        if (run_id := self.getRunId()) is None:
            return
        if store.exists(store.run(run_id).result):
            run_manifest.check_train_further(store, run_id, self.getEpochs())
        run_manifest.check_resume(store, run_id, manifest, self.getEpochs())
