"""Spark ML Params shared by TorchEstimator and TorchModel (driver side).

Each param is a real ``pyspark.ml.param.Param``; ``getX``/``setX`` accessors are generated
from the param's name (``batch_size`` -> ``getBatchSize``/``setBatchSize``). Names follow
Horovod's Spark estimator wherever it has the same concept, so migrating users keep them.
"""

from __future__ import annotations

import numbers
from typing import Any

from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import HasProbabilityCol, HasRawPredictionCol

from .spec import COLLECTIVE_TIMEOUT_S


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def _to_optional_int(value: Any) -> int | None:
    return None if value is None else TypeConverters.toInt(value)


def _to_optional_str(value: Any) -> str | None:
    return None if value is None else TypeConverters.toString(value)


def _to_optional_list_str(value: Any) -> list[str] | None:
    return None if value is None else TypeConverters.toListString(value)


def _to_optional_list_float(value: Any) -> list[float] | None:
    return None if value is None else TypeConverters.toListFloat(value)


def _to_optional_float(value: Any) -> float | None:
    return None if value is None else TypeConverters.toFloat(value)


def _to_input_shapes(value: Any) -> list[list[int]] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(s, (list, tuple)) and all(isinstance(d, int) for d in s) for s in value
    ):
        raise TypeError(f"input_shapes: expected a list of int lists, got {value!r}")
    return [list(s) for s in value]


def _to_validation(value: Any) -> float | str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"validation: expected a fraction in (0, 1) or a boolean column name, got {value!r}"
        )
    return float(value)


def _to_verbose(value: Any) -> bool:
    """A boolean, or Horovod's levels 0, 1 and 2 (2, per-epoch lines there, shows the same
    as 1 here: the bar already shows every epoch)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        if value not in (0, 1, 2):
            raise ValueError(f"verbose: expected True/False or 0, 1 or 2, got {value!r}")
        return bool(value)
    raise TypeError(f"verbose: expected True/False or 0, 1 or 2, got {value!r}")


def _param(name: str, doc: str, converter=TypeConverters.identity) -> Param:
    return Param(Params._dummy(), name, doc, typeConverter=converter)


def with_accessors(cls):
    """Add ``getX``/``setX`` for every Param declared directly on ``cls``."""
    for attr, value in list(vars(cls).items()):
        if not isinstance(value, Param):
            continue
        camel = _camel(attr)

        def getter(self, _p=attr):
            return self.getOrDefault(getattr(self, _p))

        def setter(self, value, _p=attr):
            return self._set(**{_p: value})

        getter.__doc__ = f"Gets the value of `{attr}`: {value.doc}"
        setter.__doc__ = f"Sets the value of `{attr}`: {value.doc}"
        getter.__name__, setter.__name__ = f"get{camel}", f"set{camel}"
        if not hasattr(cls, getter.__name__):
            setattr(cls, getter.__name__, getter)
        if not hasattr(cls, setter.__name__):
            setattr(cls, setter.__name__, setter)
    return cls


@with_accessors
class HasClassification(HasProbabilityCol, HasRawPredictionCol):
    """Reading the model's output as class logits, with Spark ML's classifier columns."""

    classification = _param(
        "classification",
        "read the model's single output as class logits: [B, C] with C >= 2 classes "
        "(softmax) or [B] / [B, 1] (one binary logit, sigmoid); transform then adds the "
        "class index as a double (the prediction column), probabilityCol and "
        "rawPredictionCol (ML vectors), like Spark ML classifiers",
        TypeConverters.toBoolean,
    )

    def __init__(self):
        super().__init__()
        self._setDefault(classification=False)

    def setProbabilityCol(self, value: str):
        """Sets the value of `probabilityCol`: the class probabilities' column."""
        return self._set(probabilityCol=value)

    def setRawPredictionCol(self, value: str):
        """Sets the value of `rawPredictionCol`: the logits' column."""
        return self._set(rawPredictionCol=value)


@with_accessors
class HasModelIO(HasClassification):
    """What both the estimator and the fitted model need to feed the network."""

    feature_cols = _param(
        "feature_cols",
        "input columns; each becomes one positional argument of the model's forward()",
        TypeConverters.toListString,
    )
    input_shapes = _param(
        "input_shapes",
        "optional shape per feature column, e.g. [[-1, 1, 8, 8]]: -1 first (the batch "
        "dimension, one per row), then the shape of one row",
        _to_input_shapes,
    )
    output_cols = _param(
        "output_cols",
        "names of the output columns of transform(); default 'prediction' for one model "
        "output, 'prediction_0', 'prediction_1', ... for several",
        _to_optional_list_str,
    )

    def __init__(self):
        super().__init__()
        self._setDefault(input_shapes=None, output_cols=None)


@with_accessors
class FitParams(HasModelIO):
    """The params of a fit that do not depend on how the model trains: the data, how it
    is materialized and read, the processes, the store and the run (shared by
    TorchEstimator and LightningEstimator)."""

    model = _param("model", "the module to train")
    label_cols = _param(
        "label_cols",
        "label columns; with several, the model returns one output per label",
        TypeConverters.toListString,
    )
    batch_size = _param(
        "batch_size",
        "the most rows in one step on each process: each pass over a shard is cut into "
        "ceil(largest shard / batch_size) near-equal batches, the same count on every process",
        TypeConverters.toInt,
    )
    epochs = _param("epochs", "number of passes over the training data", TypeConverters.toInt)
    num_proc = _param(
        "num_proc",
        "number of training processes (barrier tasks); default: every task slot of the cluster",
        _to_optional_int,
    )
    validation = _param(
        "validation",
        "fraction of rows held out for validation (a seeded random split), or the name of a "
        "boolean or 0/1 column marking validation rows; default none",
        _to_validation,
    )
    random_seed = _param(
        "random_seed",
        "seed of the validation split, the shuffling and torch's generators",
        TypeConverters.toInt,
    )
    store = _param("store", "the Store holding materialized data, checkpoints and results")
    use_gpu = _param(
        "use_gpu",
        "train on the GPU Spark assigned to each task; falls back to CPU where none is",
        TypeConverters.toBoolean,
    )
    run_id = _param(
        "run_id",
        "name of this run's folder in the store; generated when not set. A fit with the "
        "run_id of an unfinished run resumes from its last checkpoint",
        _to_optional_str,
    )
    collective_timeout = _param(
        "collective_timeout",
        "seconds a training process waits for the others, to form the process group and "
        "in each collective, before it gives up (a process that died or hangs)",
        TypeConverters.toFloat,
    )
    verbose = _param(
        "verbose",
        "show a progress bar on the driver during fit (epoch, steps, running loss; a widget "
        "in Jupyter with ipywidgets) and print the processes' output above it when no "
        "logging is configured for the 'spark_estimator.worker' logger (their lines are "
        "logged there either way). True/False, or Horovod's 0, 1, 2: 0 is False, 1 and 2 "
        "are True (2 shows the same as 1)",
        _to_verbose,
    )
    mlflow_logging = _param(
        "mlflow_logging",
        "log the fit to MLflow (pip install spark-estimator[mlflow]): params, per-epoch "
        "metrics and the fitted TorchModel as artifacts, into the active MLflow run or a new "
        "run named by run_id in the current experiment",
        TypeConverters.toBoolean,
    )

    # -- materialization ------------------------------------------------------------------
    partitions_per_process = _param(
        "partitions_per_process",
        "Parquet files written per training process and split when materializing",
        TypeConverters.toInt,
    )
    row_group_size_mb = _param(
        "row_group_size_mb",
        "target size of a Parquet row group in MiB: the unit of reading and of shuffling "
        "the read order",
        TypeConverters.toFloat,
    )
    compression = _param(
        "compression",
        "Parquet compression of materialized data: uncompressed, snappy, gzip or zstd",
        TypeConverters.toString,
    )
    dtype = _param(
        "dtype",
        "float type of features and non-integral labels: float32 or float64",
        TypeConverters.toString,
    )
    # -- loading ----------------------------------------------------------------------------
    reader = _param(
        "reader",
        "'arrow' (pyarrow, the default) or 'petastorm' (needs the legacy petastorm stack)",
        TypeConverters.toString,
    )
    shuffle = _param(
        "shuffle",
        "shuffle training rows every epoch (row-group order plus a shuffle buffer)",
        TypeConverters.toBoolean,
    )
    shuffle_buffer_size = _param(
        "shuffle_buffer_size",
        "rows in each process's shuffle buffer; default: as many as fit in 256 MiB",
        _to_optional_int,
    )
    reader_num_workers = _param(
        "reader_num_workers",
        "background threads reading row groups ahead of training, per process",
        TypeConverters.toInt,
    )
    inmemory_cache_all = _param(
        "inmemory_cache_all",
        "keep each process's shard in memory after the first epoch",
        TypeConverters.toBoolean,
    )
    train_steps_per_epoch = _param(
        "train_steps_per_epoch",
        "batches (forward and backward passes) per epoch, with any backward_passes_per_step; "
        "default one exact pass over the training rows",
        _to_optional_int,
    )
    validation_steps_per_epoch = _param(
        "validation_steps_per_epoch",
        "validation batches per process and epoch; default all validation rows",
        _to_optional_int,
    )
    transformation_fn = _param(
        "transformation_fn",
        "function applied to every training and validation batch on the executors: a dict "
        "column -> tensor (CPU) in, a dict with the same columns and rows out",
    )
    keep_checkpoints = _param(
        "keep_checkpoints",
        "how many of the latest epochs' checkpoints to keep in the store (TorchEstimator "
        "also keeps the best epoch's, with a BestModel callback); default all",
        _to_optional_int,
    )

    def __init__(self):
        super().__init__()
        self._setDefault(
            keep_checkpoints=None,
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
            batch_size=32,
            epochs=1,
            num_proc=None,
            validation=None,
            random_seed=0,
            store=None,
            use_gpu=True,
            run_id=None,
            collective_timeout=COLLECTIVE_TIMEOUT_S,
            verbose=True,
            mlflow_logging=False,
        )


@with_accessors
class EstimatorParams(FitParams):
    """The params of TorchEstimator's own training loop."""

    model = _param("model", "the torch.nn.Module to train")
    optimizer = _param("optimizer", "a torch.optim.Optimizer built on the model's parameters")
    learning_rate = _param(
        "learning_rate",
        "when set, the learning rate of every param group of the optimizer for this fit "
        "(before lr_scaling), e.g. to tune it with a ParamGridBuilder; the optimizer object "
        "itself is left unchanged. Default: the optimizer's own rates",
        _to_optional_float,
    )
    loss = _param(
        "loss",
        "a loss module or a function (output, label) -> scalar tensor, or a list of them, one "
        "per label column; not needed with loss_constructors",
    )
    # -- the training loop ------------------------------------------------------------------
    lr_scaling = _param(
        "lr_scaling",
        "'none' (default: learning rates as given) or 'linear' (multiplied by the number of "
        "processes, Horovod's recipe for a global batch num_proc x batch_size); the rates "
        "used are in the model's training summary",
        TypeConverters.toString,
    )
    backward_passes_per_step = _param(
        "backward_passes_per_step",
        "batches whose gradients are accumulated per optimizer step; only the last one "
        "communicates (DDP no_sync)",
        TypeConverters.toInt,
    )
    gradient_compression = _param(
        "gradient_compression",
        "'none', 'fp16' or 'bf16': the dtype gradients are averaged across processes in",
        TypeConverters.toString,
    )
    mixed_precision = _param(
        "mixed_precision",
        "'none', 'fp16' or 'bf16': torch.autocast for forward and loss (fp16 adds a "
        "GradScaler); meant for GPUs, on CPU it runs torch's CPU autocast",
        TypeConverters.toString,
    )
    metrics = _param(
        "metrics",
        "dict name -> function (output, label) -> tensor (a batch mean), or a list of "
        "functions named by __name__; averaged over all rows per epoch for train and "
        "validation and stored in the history",
    )
    loss_weights = _param(
        "loss_weights",
        "one weight per label column: the loss is sum(weight_i * loss_i)",
        _to_optional_list_float,
    )
    sample_weight_col = _param(
        "sample_weight_col",
        "numeric column of per-row loss weights: the batch loss is mean(weight * row loss)",
        _to_optional_str,
    )
    lr_scheduler = _param(
        "lr_scheduler",
        "function optimizer -> torch LR scheduler, called on each process after lr_scaling",
    )
    lr_scheduler_interval = _param(
        "lr_scheduler_interval",
        "'epoch' (default) or 'step': when the LR scheduler steps; ReduceLROnPlateau steps "
        "per epoch on the validation (else training) loss",
        TypeConverters.toString,
    )
    callbacks = _param(
        "callbacks",
        "list of spark_estimator.callbacks.Callback (EarlyStopping, BestModel or your own), "
        "run on every process",
    )
    terminate_on_nan = _param(
        "terminate_on_nan",
        "fail with an error naming the epoch and step when a training loss is NaN or "
        "infinite (checked at the end of each epoch); the last good checkpoint is kept",
        TypeConverters.toBoolean,
    )
    train_minibatch_fn = _param(
        "train_minibatch_fn",
        "your own training step fn(model, optimizer, loss_fn, inputs, labels) -> (outputs, "
        "loss) that does zero_grad, forward, backward and optimizer.step; loss_fn(outputs, "
        "labels) is the estimator's loss for the batch",
    )
    loss_constructors = _param(
        "loss_constructors",
        "list of functions () -> loss, called on each process (for losses that cannot be "
        "pickled): one for every label column, or one per label column",
    )

    def __init__(self):
        super().__init__()
        self._setDefault(
            learning_rate=None,
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
            loss=None,
        )


@with_accessors
class LightningParams(FitParams):
    """The params of LightningEstimator that TorchEstimator does not have."""

    model = _param(
        "model",
        "the lightning.pytorch.LightningModule (or pytorch_lightning.LightningModule) to "
        "train: its training_step, validation_step and configure_optimizers",
    )
    callbacks = _param(
        "callbacks",
        "list of Lightning callbacks (EarlyStopping, ModelCheckpoint or your own), run on "
        "every process; with a ModelCheckpoint that monitors a value, the fitted model has "
        "the weights of its best checkpoint",
    )
    trainer_args = _param(
        "trainer_args",
        "dict of further lightning Trainer arguments, e.g. {'precision': 'bf16-mixed', "
        "'gradient_clip_val': 1.0, 'accumulate_grad_batches': 2}; the ones the estimator "
        "sets itself (accelerator, devices, strategy, num_nodes, max_epochs, callbacks, "
        "plugins, ...) are refused",
    )

    def __init__(self):
        super().__init__()
        self._setDefault(callbacks=None, trainer_args=None)


# Params whose values are Python objects: persisted by pickle, not in JSON metadata.
OBJECT_PARAMS = (
    "model",
    "optimizer",
    "loss",
    "store",
    "transformation_fn",
    "metrics",
    "lr_scheduler",
    "callbacks",
    "train_minibatch_fn",
    "loss_constructors",
    "trainer_args",
)


def json_params(instance: Params) -> dict[str, Any]:
    """The explicitly set params of ``instance`` that go into Spark ML's JSON metadata."""
    return {p.name: v for p, v in instance._paramMap.items() if p.name not in OBJECT_PARAMS}
