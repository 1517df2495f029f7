"""Driver: TorchEstimator, the Spark ML Estimator that trains a torch model on a DataFrame
with our own DistributedDataParallel loop (``worker/loop/train.py``).

The fit itself (validate, materialize, launch, build the TorchModel) is in
``driver/fit.py``; this module checks what the loop trains with.
"""

from __future__ import annotations

import functools

from pyspark import keyword_only

from .driver import loss_probe, run_manifest, validate, validate_training
from .driver.fit import StoreEstimator, Training
from .driver.params import EstimatorParams, spark_ml_keywords
from .shared.spec import COLLECTIVE_TIMEOUT_S, COMMIT_AUTO, SPLITS, LoopSpec, metric_keys

# the params whose objects the executors rebuild from one pickle (worker/loop/objects.py)
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


class TorchEstimator(StoreEstimator, EstimatorParams):
    """Trains a ``torch.nn.Module`` on a Spark DataFrame with DistributedDataParallel.

    Each feature column becomes one positional argument of ``model.forward``; the loss is
    ``loss(output, label)`` summed over label columns (one model output per label column).
    ``loss`` should average over the batch (PyTorch's default ``reduction="mean"``).
    See ``explainParams()`` for every parameter.

    >>> est = TorchEstimator(model=net, optimizer=opt, loss=torch.nn.MSELoss(),
    ...                      feature_cols=["x"], label_cols=["y"], store=Store.create(path))
    >>> model = est.fit(df)   # a TorchModel
    """

    _BUNDLED = _BUNDLED
    _REQUIRED = ("model", "optimizer", "feature_cols", "label_cols", "store")

    @spark_ml_keywords
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
        decode_fn=None,
        collate_fn=None,
        padding_value=0.0,
        decode_workers=None,
        decode_device="cpu",
        classification=False,
        probabilityCol="probability",
        rawPredictionCol="rawPrediction",
        probability_col="probability",
        raw_prediction_col="rawPrediction",
        learning_rate=None,
        batch_size=32,
        epochs=1,
        num_proc=None,
        min_num_proc=None,
        max_restarts=3,
        elastic_timeout=600.0,
        validation=None,
        random_seed=0,
        store=None,
        use_gpu="auto",
        stage_level_scheduling=True,
        run_id=None,
        partitions_per_process=4,
        row_group_size_mb=32.0,
        compression="snappy",
        dtype="float32",
        reader="arrow",
        shuffle=True,
        shuffle_buffer_size=None,
        bucket_by_length=False,
        reader_num_workers=2,
        device_cache_fraction=0.5,
        inmemory_cache_all=False,
        train_steps_per_epoch=None,
        validation_steps_per_epoch=None,
        transformation_fn=None,
        lr_scaling="none",
        backward_passes_per_step=1,
        gradient_compression="none",
        gradient_reduction="average",
        mixed_precision="none",
        parallelism="ddp",
        fsdp_wrap=None,
        compile=False,
        metrics=None,
        loss_weights=None,
        sample_weight_col=None,
        lr_scheduler=None,
        lr_scheduler_interval="epoch",
        commit_every_steps=None,
        log_every_steps=50,
        callbacks=None,
        bad_rows="fail",
        terminate_on_nan=True,
        train_minibatch_fn=None,
        loss_constructors=None,
        keep_checkpoints=None,
        collective_timeout=COLLECTIVE_TIMEOUT_S,
        verbose=True,
        mlflow_logging=False,
    ):
        super().__init__()
        self._set(**self._input_kwargs)

    # -- what the executors train with ------------------------------------------------
    def _training(self, num_proc: int) -> Training:
        loop = self._loop_spec()
        objects = {name: self.getOrDefault(name) for name in _BUNDLED}
        objects["optimizer"] = validate_training.with_learning_rate(
            objects["optimizer"], self.getLearningRate()
        )
        bundle, metrics = validate_training.training_bundle(
            objects, self.getLabelCols(), loop.lr_scheduler_interval
        )
        validate_training.check_fsdp_wrap(objects["model"], loop.fsdp_wrap)
        names = ["loss", *metric_keys(list(metrics or {}), self.getLabelCols())]

        def check_callbacks(has_validation: bool) -> None:
            splits = SPLITS if has_validation else ("train",)
            monitorable = {f"{split}.{name}" for split in splits for name in names}
            validate_training.check_callbacks(self.getCallbacks(), monitorable)

        return Training(
            bundle=bundle,
            loop=loop,
            manifest=self._manifest(num_proc, objects["optimizer"], metrics),
            first_log=validate_training.learning_rate_note(
                objects["optimizer"],
                self.getLearningRate(),
                loop.lr_scaling,
                num_proc,
                scheduler=objects["lr_scheduler"] is not None,
            ),
            check_callbacks=check_callbacks,
            probe_loss=functools.partial(
                loss_probe.check_loss,
                bundle,
                input_shapes=self.getInputShapes(),
                loss_weights=loop.loss_weights,
            ),
        )

    def _class_index_labels(self) -> list[bool]:
        return validate_training.class_index_losses(
            self.getLoss(), self.getClassification(), self.getLabelCols()
        )

    def _commit_every_steps(self) -> int:
        """commit_every_steps for the loop: its default resolved (loop/commits.py)."""
        if self.getCommitEverySteps() is not None:
            validate.check_non_negative("commit_every_steps", self.getCommitEverySteps())
            return self.getCommitEverySteps()
        return COMMIT_AUTO if self.getMinNumProc() is not None else 0

    def _log_every_steps(self) -> int:
        """log_every_steps for the loop: None is 0 (per-epoch scalars only)."""
        every = self.getLogEverySteps()
        if every is not None:
            validate.check_non_negative("log_every_steps", every)
        return every or 0

    def _manifest(self, num_proc: int, optimizer, metrics: dict | None) -> dict:
        """What this fit's checkpoints and history depend on (but the data), with the
        optimizer it trains (``learning_rate`` applied) and the ``metrics`` as checked."""
        loss = self.getLoss()
        return run_manifest.run_manifest(
            self.getModel(),
            optimizer,
            {
                **self._run_fields(num_proc),
                "lr_scaling": self.getLrScaling(),
                "backward_passes_per_step": self.getBackwardPassesPerStep(),
                "parallelism": self.getParallelism(),
                "loss": run_manifest.described(
                    loss if loss is not None else self.getLossConstructors()
                ),
                "metrics": run_manifest.described(metrics),
                "loss_weights": self.getLossWeights(),
                "sample_weight_col": self.getSampleWeightCol(),
            },
        )

    def _loop_spec(self) -> LoopSpec:
        weights = self.getLossWeights()
        loop = LoopSpec(
            lr_scaling=self.getLrScaling(),
            backward_passes_per_step=self.getBackwardPassesPerStep(),
            gradient_compression=self.getGradientCompression(),
            gradient_reduction=self.getGradientReduction(),
            mixed_precision=self.getMixedPrecision(),
            compile=validate_training.compile_options(self.getCompile()),
            loss_weights=tuple(weights) if weights else None,
            lr_scheduler_interval=self.getLrSchedulerInterval(),
            terminate_on_nan=self.getTerminateOnNan(),
            commit_every_steps=self._commit_every_steps(),
            log_every_steps=self._log_every_steps(),
            parallelism=self.getParallelism(),
            fsdp_wrap=tuple(self.getFsdpWrap() or ()),
        )
        validate_training.check_loop(loop, self.getLabelCols(), self.getTrainMinibatchFn())
        return loop
