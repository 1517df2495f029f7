"""Driver: LightningEstimator, the Spark ML Estimator that trains a Lightning module.

The module's own ``training_step``, ``validation_step`` and ``configure_optimizers`` run in
a Lightning Trainer on every barrier task, with DDP over the job's process group, fed by
the same data path as TorchEstimator (``worker.lightning.train``). The fit itself
(validate, materialize, launch, build the TorchModel) is ``StoreEstimator.fit``.
Lightning is an optional extra: ``pip install 'spark-estimator[lightning]'``.
"""

from __future__ import annotations

import functools

from .driver import run_manifest, validate_lightning
from .driver.constructors import LightningEstimatorConstructor
from .driver.fit import StoreEstimator
from .driver.fit_checks import Training
from .driver.params import LightningParams
from .model import TorchModel


class LightningEstimator(LightningEstimatorConstructor, StoreEstimator, LightningParams):
    """Trains a ``LightningModule`` (lightning 2.x) on a Spark DataFrame.

    A Spark ML Estimator: ``fit`` checks every param and column on the driver, writes the
    selected columns once to Parquet in the ``store``, runs the module's own
    ``training_step``, ``validation_step`` and ``configure_optimizers`` in a Lightning
    Trainer on ``num_proc`` barrier tasks (DDP over the job's process group) and returns a
    ``TorchModel``.

    Every batch the module sees is a dict column name -> tensor on its device: the feature
    columns (shaped by ``input_shapes``) and the label columns, so ``training_step`` reads
    e.g. ``batch["features"]`` and ``batch["label"]``. What it logs per epoch with
    ``self.log`` goes into the model's history (``train`` or ``validation``, by the loop
    that logged it; a mean is exact over all processes' rows), with ``train.loss``, the
    mean of ``training_step``'s loss. Lightning callbacks run on every process. The fitted
    TorchModel's ``transform`` calls the module's ``forward`` with the feature columns.

    The constructor's Parameters section (``help(LightningEstimator.__init__)``),
    ``explainParams()`` and docs/parameters.md describe every parameter; docs/lightning.md
    the rest. Lightning is an optional extra: ``pip install 'spark-estimator[lightning]'``.

    Examples
    --------
    >>> from spark_estimator import LightningEstimator, Store
    >>> est = LightningEstimator(model=MyModule(), feature_cols=["features"],
    ...                          label_cols=["label"], store=Store.create("/tmp/store"),
    ...                          epochs=5)                              # doctest: +SKIP
    >>> model = est.fit(df)                                             # doctest: +SKIP
    >>> model.getHistory()[-1]["train"]["loss"]                         # doctest: +SKIP
    """

    _MODEL = TorchModel
    _BUNDLED = ("model", "callbacks", "trainer_args", "profiler")
    _TRAINER = "lightning"

    def _training(self, num_proc: int) -> Training:
        model, callbacks = self.getModel(), self.getCallbacks()
        pl = validate_lightning.check_module(model)
        validate_lightning.check_callbacks(pl, callbacks)
        trainer_args = validate_lightning.check_trainer_args(pl, self.getTrainerArgs())
        trainer_args = validate_lightning.with_profiler(pl, trainer_args, self.getProfiler())
        bundle = validate_lightning.lightning_bundle(
            model, callbacks, trainer_args, self.getTerminateOnNan()
        )
        fields = {
            **self._run_fields(num_proc),
            "accumulate_grad_batches": trainer_args.get("accumulate_grad_batches", 1),
        }
        return Training(
            bundle=bundle,
            loop=None,
            manifest=run_manifest.run_manifest(model, None, fields),
            check_callbacks=functools.partial(validate_lightning.check_monitors, model, callbacks),
        )

    def _class_index_labels(self) -> list[bool]:
        """With ``classification``, the module gets its label columns as int64 class
        indices (StringIndexer's doubles too), as TorchEstimator's loss does."""
        return [self.getClassification()] * len(self.getLabelCols())
