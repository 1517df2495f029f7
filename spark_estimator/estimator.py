"""Driver: TorchEstimator, the Spark ML Estimator that trains a torch model on a DataFrame
with our own DistributedDataParallel loop (``worker.loop.train``).

The fit itself (validate, materialize, launch, build the TorchModel) is
``StoreEstimator.fit``; this module checks what the loop trains with.
"""

from __future__ import annotations

import functools

from .driver import loss_probe, run_manifest, validate, validate_training
from .driver.constructors import TorchEstimatorConstructor
from .driver.fit import StoreEstimator
from .driver.fit_checks import Training
from .driver.params import EstimatorParams
from .model import TorchModel
from .shared.spec import COMMIT_AUTO, LoopSpec

# the params whose objects the executors rebuild from one pickle (worker.loop.objects)
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


class TorchEstimator(TorchEstimatorConstructor, StoreEstimator, EstimatorParams):
    """Trains a ``torch.nn.Module`` on a Spark DataFrame with DistributedDataParallel.

    A Spark ML Estimator: ``fit`` checks every param and column on the driver, writes the
    selected columns once to Parquet in the ``store``, trains on ``num_proc`` barrier tasks
    with our own training loop and returns a ``TorchModel``. Each feature column becomes one
    positional argument of ``model.forward``; the loss is ``loss(output, label)`` summed over
    label columns (one model output per label column). ``loss`` should average over the
    batch (PyTorch's default ``reduction="mean"``).

    The constructor's Parameters section (``help(TorchEstimator.__init__)``),
    ``explainParams()`` and docs/parameters.md describe every parameter.

    Examples
    --------
    >>> import torch
    >>> from spark_estimator import Store, TorchEstimator
    >>> net = torch.nn.Linear(3, 1)
    >>> est = TorchEstimator(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
    ...                      loss=torch.nn.MSELoss(), feature_cols=["x"], label_cols=["y"],
    ...                      epochs=5, store=Store.create("/tmp/store"))
    >>> model = est.fit(df)                                             # doctest: +SKIP
    >>> model.transform(df).select("prediction").show(3)                # doctest: +SKIP
    """

    _MODEL = TorchModel
    _STRING_LABELS = False  # the loss takes numbers: a string label needs a decode_fn
    _BUNDLED = _BUNDLED
    _REQUIRED = ("model", "optimizer", "feature_cols", "label_cols", "store")

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

        def check_callbacks(has_validation: bool) -> None:
            monitorable = validate_training.recorded_metrics(
                list(metrics or {}), self.getLabelCols(), has_validation
            )
            validate_training.check_callbacks(self.getCallbacks(), set(monitorable))

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
        """commit_every_steps for the loop: its default resolved (``worker.loop.commits``)."""
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
