"""Spark ML Params of TorchEstimator, LightningEstimator, TorchModel and OptunaSearch (driver
side): the declarations of the params. Over 500 lines by design: it declares some 85 params and
keywords, each with its doc (the text of ``explainParams()``, docs/parameters.md and the
constructors' docstrings); the machinery they are declared with is in the
``param_specs`` module.

Each param is written once, as a ``ParamSpec`` (name, doc, type converter, default) in the
``_specs`` of the class that declares it; ``SpecParams`` makes the real
``pyspark.ml.param.Param`` of every spec and sets the defaults. The ``getX``/``setX``
accessors (``batch_size`` -> ``getBatchSize``/``setBatchSize``) are plain methods of the
mixins of the ``param_accessors`` module, which the docs' generator (``gen_parameters``, see
docs/parameters.md) writes from the specs, so editors and type checkers see them (the docs
tests fail when it is out of date).
Names follow Horovod's Spark estimator wherever it has the same concept, so migrating users
keep them; Spark's ``probabilityCol`` and ``rawPredictionCol`` are also accepted as
``probability_col`` and ``raw_prediction_col``.
"""

from __future__ import annotations

from typing import Any

from pyspark.ml.param import Params, TypeConverters
from pyspark.ml.param.shared import HasProbabilityCol, HasRawPredictionCol

from ..shared.spec import COLLECTIVE_TIMEOUT_S, DECODE_FUNCTIONS
from . import param_accessors as accessors
from .elastic import ELASTIC_TIMEOUT_S, MAX_RESTARTS
from .param_specs import (
    ParamSpec,
    SpecParams,
    check_keywords,
    param_specs,
    spark_names,
    to_class_names,
    to_column_names,
    to_input_shapes,
    to_loss,
    to_optional_float,
    to_optional_int,
    to_optional_list_float,
    to_optional_list_str,
    to_optional_str,
    to_use_gpu,
    to_validation,
    to_verbose,
)


class HasClassification(
    accessors.HasClassificationAccessors, HasProbabilityCol, HasRawPredictionCol, SpecParams
):
    """Reading the model's output as class logits, with Spark ML's classifier columns
    (``probabilityCol``/``probability_col``, ``rawPredictionCol``/``raw_prediction_col``:
    either spelling as a keyword, ``getProbabilityCol``/``setProbabilityCol`` for both)."""

    _specs = (
        ParamSpec(
            "classification",
            "read the model's single output as class logits: [B, C] with C >= 2 classes "
            "(softmax) or [B] / [B, 1] (one binary logit, sigmoid); transform then adds the "
            "class index as a double (the prediction column), probabilityCol and "
            "rawPredictionCol (ML vectors), like Spark ML classifiers",
            TypeConverters.toBoolean,
            default=False,
        ),
    )

    def _set(self, **kwargs: Any):
        """Sets params by name, taking the snake_case spellings too (the estimators'
        keywords and ``setParams`` come through here); Spark ML's names of column params
        are refused naming ours (``SPARK_ML_NAMES``), other unknown names naming the
        closest params (``check_keywords``)."""
        check_keywords(self, kwargs)
        return super()._set(**spark_names(kwargs))

    def setProbabilityCol(self, value: str):
        """Sets the value of `probabilityCol`: the class probabilities' column."""
        return self._set(probabilityCol=value)

    def setRawPredictionCol(self, value: str):
        """Sets the value of `rawPredictionCol`: the logits' column."""
        return self._set(rawPredictionCol=value)


class HasModelIO(accessors.HasModelIOAccessors, HasClassification):
    """What both the estimator and the fitted model need to feed the network."""

    _specs = (
        ParamSpec(
            "feature_cols",
            "input columns; each becomes one positional argument of the model's forward() (one "
            "name alone is taken as a one-element list; Spark ML's featuresCol is not a param "
            "here)",
            to_column_names,
        ),
        ParamSpec(
            "input_shapes",
            "optional shape per feature column: one row's shape, e.g. [[1, 8, 8]] for rows "
            "of 64 values, or the batch's with -1 first (the rows), [[-1, 1, 8, 8]]",
            to_input_shapes,
            default=None,
        ),
        ParamSpec(
            "output_cols",
            "names of the output columns of transform(); default 'prediction' for one model "
            "output, 'prediction_0', 'prediction_1', ... for several",
            to_optional_list_str,
            default=None,
        ),
        # -- variable columns (images, text, sequences): worker.data.decode ----------------
        ParamSpec(
            "decode_fn",
            "function (row, augment) -> row applied to every row's variable columns (binary, "
            "string, Spark image struct, arrays of varying length) by each process's decode "
            "workers (decode_pool): row is a dict column -> bytes, str, image dict or 1-D NumPy "
            "array; augment a numpy.random.Generator seeded by (random_seed, epoch, row) in "
            "training, None in validation and transform. Returns a dict with a value (a tensor) "
            "for each of those columns. Default: encoded images decoded to uint8 [C, H, W] "
            "(RGB; spark_estimator.decoding.decode_images, a batch at a time), image structs "
            "likewise, sequences as 1-D tensors, strings left as they are",
            default=None,
            hint="Callable[[dict[str, Any], np.random.Generator | None], dict[str, Any]]",
        ),
        ParamSpec(
            "decode_batch_fn",
            "the batch form of decode_fn (one or the other): function (rows, augments) -> dict "
            "called once per batch, for work that is faster a batch at a time (tokenizers' "
            "encode_batch, vectorised augmentation): rows is a dict column -> list of the "
            "batch's values (as decode_fn's row holds them), augments a list of each row's "
            "numpy.random.Generator (as decode_fn's augment) in training, None otherwise. "
            "Returns a dict column -> the batch's tensor [B, ...] or a list of B row tensors "
            "(stacked or padded as decode_fn's), and '<column>_mask' entries. With "
            "decode_device='cuda' it runs in the training process after the JPEG columns were "
            "decoded on its GPU, and gets them as a uint8 [B, 3, H, W] CUDA tensor",
            default=None,
            hint="Callable[[dict[str, list], list[np.random.Generator] | None], dict[str, Any]]",
        ),
        ParamSpec(
            "decode_init_fn",
            "function () called once in each decode worker before it decodes (each process of "
            "decode_pool='processes', or once per training process with threads), as a "
            "DataLoader's worker_init_fn: load a tokenizer once, into a global that decode_fn "
            "or decode_batch_fn reads (they are pickled together, so share their globals)",
            default=None,
            hint="Callable[[], None]",
        ),
        ParamSpec(
            "collate_fn",
            "function (list of decoded rows) -> dict column -> batch tensor, as a DataLoader's "
            "collate_fn; an entry '<column>_mask' is handed to forward() after that column. "
            "Default: tensors of one shape stacked, 1-D tensors (sequences) padded to the "
            "batch's longest with padding_value plus their mask (True at the row's values, "
            "the argument after the column's), strings as lists",
            default=None,
            hint="Callable[[list[dict[str, Any]]], dict[str, Any]]",
        ),
        ParamSpec(
            "padding_value",
            "the value feature sequences are padded with to the batch's longest (integer label "
            "sequences are padded with -100, which CrossEntropyLoss ignores)",
            TypeConverters.toFloat,
            default=0.0,
        ),
        ParamSpec(
            "decode_pool",
            "where each process decodes its batches' variable columns: 'processes' (worker "
            "processes, each decoding whole batches into shared memory, off the training "
            "process's GIL), 'threads' (threads of the training process; Pillow and "
            "tokenizers release the GIL, Python in a decode_fn does not) or 'auto' (the "
            "default: processes where a task has more than 2 CPUs, else threads)",
            TypeConverters.toString,
            default="auto",
        ),
        ParamSpec(
            "decode_workers",
            "how many threads or processes (decode_pool) decode on each training process; "
            "default: with threads the task's CPUs, with processes the task's CPUs less 2 (at "
            "least 1), which leave the training and its batch thread a core each",
            to_optional_int,
            default=None,
        ),
        ParamSpec(
            "decode_device",
            "where encoded images (binary columns) are decoded: 'cpu' (the decode workers) or "
            "'cuda' (JPEGs on the process's GPU, a batch at a time, with "
            "torchvision.io.decode_jpeg; needs torchvision that loads with the installed torch, "
            "and no decode_fn; per-row augmentation there with decode_batch_fn)",
            TypeConverters.toString,
            default="cpu",
        ),
        ParamSpec(
            "decode_timeout",
            "the seconds one batch's decoding may take before the process fails naming the "
            "batch's first row and its file (as DataLoader's timeout): a decode_fn waiting "
            "on a read that never returns (a stuck network file system, an HTTP fetch) ends "
            "the fit or transform instead of hanging it; its worker process is stopped (a "
            "thread is left to end by itself). None: no limit",
            to_optional_float,
            default=None,
        ),
    )


class FitParams(accessors.FitParamsAccessors, HasModelIO):
    """The params of a fit that do not depend on how the model trains: the data, how it
    is materialized and read, the processes, the store and the run (shared by
    TorchEstimator and LightningEstimator)."""

    _specs = (
        ParamSpec(
            "model", "the module to train", hint="torch.nn.Module | Callable[[], torch.nn.Module]"
        ),
        ParamSpec(
            "label_cols",
            "label columns; with several, the model returns one output per label (one name "
            "alone is taken as a one-element list; Spark ML's labelCol is not a param here)",
            to_column_names,
        ),
        ParamSpec(
            "batch_size",
            "the most rows in one step on each process: each pass over a shard is cut into "
            "ceil(largest shard / batch_size) near-equal batches, the same count on every "
            "process",
            TypeConverters.toInt,
            default=32,
        ),
        ParamSpec(
            "epochs", "number of passes over the training data", TypeConverters.toInt, default=1
        ),
        ParamSpec(
            "num_proc",
            "number of training processes (barrier tasks); default: every task slot of the cluster",
            to_optional_int,
            default=None,
        ),
        ParamSpec(
            "min_num_proc",
            "elastic training: after processes are lost (a killed process, a lost executor), "
            "the fit starts again from its last checkpoint with as many processes as the "
            "cluster can run then, at least min_num_proc and at most num_proc, and grows back "
            "toward num_proc at an epoch's end when slots return; default: num_proc (a fixed "
            "size, started again once the cluster has num_proc slots)",
            to_optional_int,
            default=None,
        ),
        ParamSpec(
            "max_restarts",
            "how many times a fit is started again after losing processes before it fails",
            TypeConverters.toInt,
            default=MAX_RESTARTS,
        ),
        ParamSpec(
            "elastic_timeout",
            "seconds to wait, after processes were lost, for the cluster to offer at least "
            "min_num_proc task slots before the fit fails",
            TypeConverters.toFloat,
            default=ELASTIC_TIMEOUT_S,
        ),
        ParamSpec(
            "validation",
            "fraction of rows held out for validation (a seeded random split), or the name of a "
            "boolean or 0/1 column marking validation rows; default none",
            to_validation,
            default=None,
        ),
        ParamSpec(
            "random_seed",
            "seed of the validation split, the shuffling and torch's generators",
            TypeConverters.toInt,
            default=0,
        ),
        ParamSpec(
            "store",
            "the Store holding materialized data, checkpoints and results",
            default=None,
            hint="Store",
        ),
        ParamSpec(
            "use_gpu",
            "'auto': train on the GPU Spark assigned to each task, on the CPU where the cluster "
            "has no GPUs configured (a warning where it has but a task got none); True: "
            "require a GPU for every task (an error without one); False: the CPU",
            to_use_gpu,
            default="auto",
        ),
        ParamSpec(
            "stage_level_scheduling",
            "on a cluster whose executors have one GPU each and whose tasks get less than a "
            "whole GPU (a fractional spark.task.resource.gpu.amount, so that ETL runs a task "
            "per core, or none), run the training job alone with a task resource profile of "
            "one GPU and all of an executor's cores per task: one training process per GPU. "
            "Needs Spark 3.4 or later on standalone (YARN and Kubernetes from 3.5.1), not a "
            "local master; where it does not apply the job keeps the cluster's task resources "
            "and the driver logs why, once (docs/gpu.md). False: the cluster's task resources "
            "always",
            TypeConverters.toBoolean,
            default=True,
        ),
        ParamSpec(
            "run_id",
            "name of this run's folder in the store; generated when not set. A fit with the "
            "run_id of an unfinished run resumes from its last checkpoint; of a finished run, "
            "with more epochs, trains the missing epochs from its last checkpoint",
            to_optional_str,
            default=None,
        ),
        ParamSpec(
            "collective_timeout",
            "seconds a training process waits for the others, to form the process group and "
            "in each collective, before it gives up (a process that died or hangs)",
            TypeConverters.toFloat,
            default=COLLECTIVE_TIMEOUT_S,
        ),
        ParamSpec(
            "verbose",
            "show a progress bar on the driver during fit (epoch, steps, running loss; a widget "
            "in Jupyter with ipywidgets) and print the processes' output above it when no "
            "logging is configured for the 'spark_estimator.worker' logger (their lines are "
            "logged there either way). True/False, or Horovod's 0, 1, 2: 0 is False, 1 and 2 "
            "are True (2 shows the same as 1)",
            to_verbose,
            default=True,
        ),
        ParamSpec(
            "mlflow_logging",
            "log the fit to MLflow (pip install spark-estimator[mlflow]): params, per-epoch "
            "metrics and the fitted TorchModel as artifacts, into the active MLflow run or a new "
            "run named by run_id in the current experiment",
            TypeConverters.toBoolean,
            default=False,
        ),
        ParamSpec(
            "mlflow_code_paths",
            "with mlflow_logging: files and folders of your own code that the logged model "
            "needs where it is loaded (MLflow's code_paths: put first on sys.path there), "
            "beside the modules of yours its pickle names, which are shipped anyway; e.g. a "
            "module the model imports by name inside forward",
            TypeConverters.toListString,
            default=None,
            hint="list[str]",
        ),
        ParamSpec(
            "callbacks",
            "list of callbacks run on every process (see each estimator)",
            default=None,
            hint="list[Any]",
        ),
        ParamSpec(
            "bad_rows",
            "what a row of a variable column that fails to decode (a corrupt image) does: "
            "'fail' (default) raises naming the column, the row and its path or origin; "
            "'skip' leaves it out of its batch, counted in the training summary "
            "(rows_skipped)",
            TypeConverters.toString,
            default="fail",
        ),
        # -- materialization ----------------------------------------------------------------
        ParamSpec(
            "partitions_per_process",
            "Parquet files written per training process and split when materializing",
            TypeConverters.toInt,
            default=4,
        ),
        ParamSpec(
            "row_group_size_mb",
            "target size of a Parquet row group in MiB: the unit of reading and of shuffling "
            "the read order",
            TypeConverters.toFloat,
            default=32.0,
        ),
        ParamSpec(
            "compression",
            "Parquet compression of materialized data: uncompressed, snappy, gzip or zstd",
            TypeConverters.toString,
            default="snappy",
        ),
        ParamSpec(
            "data_copy",
            "'auto' (default): a DataFrame that only reads Parquet files on the store's "
            "filesystem (spark.read.parquet, a table over Parquet; selecting columns) is "
            "trained on where the files lie, without a copy, and any other is materialized "
            "(the reason logged at INFO); 'always': always materialize a copy; 'never': "
            "train in place or fail naming why not",
            TypeConverters.toString,
            default="auto",
        ),
        ParamSpec(
            "dtype",
            "float type of features and non-integral labels: float32 or float64",
            TypeConverters.toString,
            default="float32",
        ),
        # -- loading --------------------------------------------------------------------------
        ParamSpec(
            "reader",
            "'arrow' (pyarrow, the default) or 'petastorm' (needs the legacy petastorm stack)",
            TypeConverters.toString,
            default="arrow",
        ),
        ParamSpec(
            "shuffle",
            "shuffle training rows every epoch (row-group order plus a shuffle buffer)",
            TypeConverters.toBoolean,
            default=True,
        ),
        ParamSpec(
            "shuffle_buffer_size",
            "rows in each process's shuffle buffer; default: as many as fit in 256 MiB",
            to_optional_int,
            default=None,
        ),
        ParamSpec(
            "bucket_by_length",
            "length bucketing: training batches of rows of similar lengths, so that sequences "
            "(arrays of varying length) and strings are padded less. The rows each refill of "
            "the shuffle buffer serves are sorted by length (summed over the sequence and "
            "string columns) and cut into groups of 8 x batch_size rows, served in a random "
            "order; every row is still trained on once per epoch. Needs shuffle and a string "
            "or array feature or label column; the training summary's padding shows the "
            "padding left",
            TypeConverters.toBoolean,
            default=False,
        ),
        ParamSpec(
            "reader_num_workers",
            "background threads reading row groups ahead of training, per process",
            TypeConverters.toInt,
            default=2,
        ),
        ParamSpec(
            "device_cache_fraction",
            "hold each process's shard of the data in its device's memory for the whole fit "
            "(GPU memory, or RAM on CPU) when it takes at most this fraction of what is free "
            "there (RAM: shared by the host's processes), read once and cut into batches on "
            "the device; else stream it. 0 always streams",
            TypeConverters.toFloat,
            default=0.5,
        ),
        ParamSpec(
            "inmemory_cache_all",
            "when streaming, keep each process's shard in host memory after the first epoch",
            TypeConverters.toBoolean,
            default=False,
        ),
        ParamSpec(
            "train_steps_per_epoch",
            "batches (forward and backward passes) per epoch, with any "
            "backward_passes_per_step; default one exact pass over the training rows",
            to_optional_int,
            default=None,
        ),
        ParamSpec(
            "validation_steps_per_epoch",
            "validation batches per process and epoch; default all validation rows",
            to_optional_int,
            default=None,
        ),
        ParamSpec(
            "transformation_fn",
            "function applied to every training and validation batch on the executors: a dict "
            "column -> tensor (CPU) in, a dict with the same columns and rows out",
            default=None,
            hint="Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]",
        ),
        ParamSpec(
            "keep_checkpoints",
            "how many of the latest epochs' checkpoints to keep in the store (TorchEstimator "
            "also keeps the best epoch's, with a BestModel callback); default all",
            to_optional_int,
            default=None,
        ),
        ParamSpec(
            "terminate_on_nan",
            "fail with an error naming the epoch and step when a training loss (Lightning: "
            "training_step's) is NaN or infinite (checked at the end of each epoch); the last "
            "good checkpoint is kept",
            TypeConverters.toBoolean,
            default=True,
        ),
    )


_FIT = param_specs(FitParams)


class EstimatorParams(accessors.EstimatorParamsAccessors, FitParams):
    """The params of TorchEstimator's own training loop."""

    _specs = (
        _FIT["model"].with_doc(
            "the torch.nn.Module to train, or a function () -> Module called on each process "
            "(the driver builds it only for the fitted model; with parallelism='fsdp' and "
            "torch.device('meta') inside it each process materializes only its shard)"
        ),
        ParamSpec(
            "optimizer",
            "a torch.optim.Optimizer built on the model's parameters; an Optimizer class "
            "(torch.optim.Adam), built on each process on the model's parameters with "
            "learning_rate or its default lr; or a function model -> Optimizer called on each "
            "process with the model as it trains (a class or a function when model is a "
            "function)",
            hint="torch.optim.Optimizer | type[torch.optim.Optimizer] "
            "| Callable[[torch.nn.Module], torch.optim.Optimizer]",
        ),
        ParamSpec(
            "learning_rate",
            "when set, the learning rate of every param group of the optimizer for this fit "
            "(before lr_scaling), e.g. to tune it with a ParamGridBuilder; the optimizer object "
            "itself is left unchanged. A run trained further at another rate goes on at the "
            "new one. Default: the optimizer's own rates",
            to_optional_float,
            default=None,
        ),
        ParamSpec(
            "loss",
            "a loss module or a function (output, label) -> scalar tensor, or the name of "
            "torch's: 'mse', 'mae' / 'l1', 'cross_entropy', 'nll', 'bce', 'bce_with_logits', "
            "'smooth_l1', 'huber', 'kl_div', 'poisson_nll' (that torch.nn module with its "
            "defaults, e.g. MSELoss(), which getLoss() then returns); or a list of them, one "
            "per label column; not needed with loss_constructors",
            to_loss,
            default=None,
            hint="str | Callable[..., torch.Tensor] | list[str | Callable[..., torch.Tensor]]",
        ),
        # -- the training loop ----------------------------------------------------------------
        ParamSpec(
            "lr_scaling",
            "'none' (default: learning rates as given) or 'linear' (multiplied by the number of "
            "processes, Horovod's recipe for a global batch num_proc x batch_size); the rates "
            "used are in the model's training summary",
            TypeConverters.toString,
            default="none",
        ),
        ParamSpec(
            "backward_passes_per_step",
            "batches whose gradients are accumulated per optimizer step; only the last one "
            "communicates (DDP no_sync)",
            TypeConverters.toInt,
            default=1,
        ),
        ParamSpec(
            "gradient_compression",
            "'none', 'fp16' or 'bf16': the dtype gradients are averaged across processes in",
            TypeConverters.toString,
            default="none",
        ),
        ParamSpec(
            "gradient_reduction",
            "'average' (default: the mean of the processes' gradients) or 'adasum' (Horovod's "
            "Adasum, per parameter, in float64; learning rates are not scaled with it, so "
            "lr_scaling must be 'none'); gradient_compression still sets the dtype sent",
            TypeConverters.toString,
            default="average",
        ),
        ParamSpec(
            "mixed_precision",
            "'none', 'fp16' or 'bf16': torch.autocast for forward and loss (fp16 adds a "
            "GradScaler); meant for GPUs, on CPU it runs torch's CPU autocast",
            TypeConverters.toString,
            default="none",
        ),
        ParamSpec(
            "parallelism",
            "'ddp' (default: every process holds the whole model, DistributedDataParallel) or "
            "'fsdp' (the model's parameters, gradients and optimizer state sharded over the "
            "processes with FSDP2, for models larger than one device; checkpoints sharded "
            "too; see docs/large-models.md)",
            TypeConverters.toString,
            default="ddp",
        ),
        ParamSpec(
            "fsdp_wrap",
            "parallelism='fsdp': the submodule classes (or class names, e.g. your transformer "
            "block) sharded as units of their own, each gathered only while it computes; the "
            "whole model is always one unit; default: none (the model is one unit)",
            to_class_names,
            default=None,
        ),
        ParamSpec(
            "compile",
            "False (default), True or a dict of torch.compile keyword arguments (e.g. "
            "{'backend': 'aot_eager'}, {'mode': 'max-autotune'}, {'dynamic': True}): each "
            "process trains torch.compile of the model inside DistributedDataParallel; "
            "validation runs the model uncompiled; checkpoints and the fitted model hold the "
            "plain model's weights",
            default=False,
            hint="bool | dict[str, Any]",
        ),
        ParamSpec(
            "metrics",
            "dict name -> function (output, label) -> tensor (a batch mean), or a list of "
            "functions named by __name__; averaged over all rows per epoch for train and "
            "validation and stored in the history",
            default=None,
            hint="dict[str, Callable[..., torch.Tensor]] | list[Callable[..., torch.Tensor]]",
        ),
        ParamSpec(
            "loss_weights",
            "one weight per label column: the loss is sum(weight_i * loss_i)",
            to_optional_list_float,
            default=None,
        ),
        ParamSpec(
            "sample_weight_col",
            "numeric column of per-row loss weights: the batch loss is mean(weight * row loss)",
            to_optional_str,
            default=None,
        ),
        ParamSpec(
            "lr_scheduler",
            "function optimizer -> torch LR scheduler, called on each process after lr_scaling",
            default=None,
            hint="Callable[[torch.optim.Optimizer], Any]",
        ),
        ParamSpec(
            "lr_scheduler_interval",
            "'epoch' (default) or 'step': when the LR scheduler steps; ReduceLROnPlateau steps "
            "per epoch on the validation (else training) loss",
            TypeConverters.toString,
            default="epoch",
        ),
        ParamSpec(
            "commit_every_steps",
            "commit the training state every this many optimizer steps (each of "
            "backward_passes_per_step batches; a commit only after a batch that ends one) "
            "inside an epoch to runs/<run_id>/commit.pt (model, optimizer, scheduler, scaler, "
            "callbacks, random state, the epoch's sums and rows), so that a fit started again "
            "after lost processes goes on from there, re-sharding the epoch's remaining rows "
            "when the number of processes changed; 0: only the epochs' checkpoints; default: in "
            "an elastic fit (min_num_proc set) once in the middle of the first epoch, then "
            "every epoch as often as keeps the commits under 5% of the training time, timed "
            "again each epoch, at most 4 times and at least once an epoch, else 0",
            to_optional_int,
            default=None,
        ),
        ParamSpec(
            "log_every_steps",
            "every this many training batches (the steps of train_steps_per_epoch, not "
            "optimizer steps), rank 0 adds to the run's TensorBoard file its training loss "
            "(the mean over the batches since the previous point of the epoch) and learning "
            "rates, as step/train_loss and step/lr_group_<i>, on a step axis that counts the "
            "run's batches across epochs and resumes (step/epoch marks each epoch's end); 0 "
            "or None: the per-epoch scalars only",
            to_optional_int,
            default=50,
        ),
        _FIT["callbacks"].with_doc(
            "list of spark_estimator.callbacks.Callback (EarlyStopping, BestModel or your "
            "own), run on every process"
        ),
        ParamSpec(
            "train_minibatch_fn",
            "your own training step fn(model, optimizer, loss_fn, inputs, labels) -> (outputs, "
            "loss) that does zero_grad, forward, backward and optimizer.step; loss_fn(outputs, "
            "labels) is the estimator's loss for the batch",
            default=None,
            hint="Callable[..., tuple[Any, torch.Tensor]]",
        ),
        ParamSpec(
            "loss_constructors",
            "list of functions () -> loss, called on each process (for losses that cannot be "
            "pickled): one for every label column, or one per label column",
            default=None,
            hint="list[Callable[[], Callable[..., torch.Tensor]]]",
        ),
    )


class LightningParams(accessors.LightningParamsAccessors, FitParams):
    """The params of LightningEstimator that TorchEstimator does not have."""

    _specs = (
        _FIT["model"].with_doc(
            "the lightning.pytorch.LightningModule (or pytorch_lightning.LightningModule) to "
            "train: its training_step, validation_step and configure_optimizers"
        ),
        _FIT["callbacks"].with_doc(
            "list of Lightning callbacks (EarlyStopping, ModelCheckpoint or your own), run on "
            "every process; with a ModelCheckpoint that monitors a value, the fitted model has "
            "the weights of its best checkpoint"
        ),
        ParamSpec(
            "trainer_args",
            "dict of further lightning Trainer arguments, e.g. {'precision': 'bf16-mixed', "
            "'gradient_clip_val': 1.0, 'accumulate_grad_batches': 2}; the ones the estimator "
            "sets itself (accelerator, devices, strategy, num_nodes, max_epochs, callbacks, "
            "plugins, ...) are refused",
            default=None,
            hint="dict[str, Any]",
        ),
        ParamSpec(
            "profiler",
            "the Lightning Trainer's profiler, as Horovod's profiler argument: 'simple', "
            "'advanced', 'pytorch' or a lightning Profiler object. Every rank profiles; "
            "Lightning logs rank 0's report, or, with a profiler's dirpath and filename, "
            "writes every rank's to <dirpath>/fit-<filename>-0.txt on its host (Lightning "
            "numbers it by local rank: 0 in every task). Default: none",
            default=None,
            hint="str | Any",
        ),
    )


class ModelParams(accessors.ModelParamsAccessors, HasModelIO):
    """The params of TorchModel: the trained module and how to feed it."""

    # TorchModel's keywords that are not params: what fit hands the model it returns
    KEYWORDS = (
        ParamSpec(
            "history",
            "the per-epoch records of the fit (getHistory())",
            default=None,
            hint="list[dict]",
        ),
        ParamSpec(
            "output_shapes",
            "each output's shape without the batch dimension (a double column for [] or [1], "
            "else array<float>)",
            default=None,
            hint="list[list[int]]",
        ),
        ParamSpec("run_id", "the fit's run folder in the store", default=None, hint="str"),
        ParamSpec(
            "training_summary",
            "how the model was trained (getTrainingSummary())",
            default=None,
            hint="dict",
        ),
        ParamSpec(
            "feature_kinds",
            "column -> [kind, dtype] fit read it as, where the schema cannot tell (arrays of "
            "varying length are 'sequence's)",
            default=None,
            hint="dict[str, list[str]]",
        ),
        ParamSpec(
            "fit_label_cols",
            "the label columns of the fit (transform's rows do not hold them: a decode_fn "
            "that reads one is told so)",
            default=None,
            hint="list[str]",
        ),
        ParamSpec(
            "feature_lengths",
            "column -> the number of values each row of an array or vector feature column "
            "held in the fit (the shapes of the MLflow model's tensor signature)",
            default=None,
            hint="dict[str, int]",
        ),
    )

    _specs = (
        _FIT["model"].with_doc("the trained torch.nn.Module", hint="torch.nn.Module"),
        _FIT["dtype"].with_doc(
            "float type the features are cast to for the model: float32 or float64 (the "
            "estimator's dtype, set by fit)"
        ),
        _FIT["stage_level_scheduling"].with_doc(
            "run transform's tasks with a task resource profile of one GPU and all of an "
            "executor's cores each, where the estimator's training job would get one (see "
            "the estimator's stage_level_scheduling; fit hands its value on): one model per "
            "GPU, fed Arrow batches of spark.sql.execution.arrow.maxRecordsPerBatch rows. "
            "False: the cluster's task resources, where a task gets a share of a GPU or none"
        ),
    )


class SearchParams(accessors.SearchParamsAccessors, SpecParams):
    """The params of OptunaSearch (``spark_estimator.tuning``): the estimator it tunes, the
    search space, what it optimizes, the trials and the Optuna study they go into."""

    _specs = (
        ParamSpec(
            "estimator",
            "the TorchEstimator or LightningEstimator to tune: every trial fits a copy of it "
            "with the trial's params",
            hint="Any",
        ),
        ParamSpec(
            "space",
            "the search space: a function optuna.Trial -> dict of the estimator's params "
            "(names or Params) and their values for that trial, e.g. {'learning_rate': "
            "trial.suggest_float('lr', 1e-4, 1e-1, log=True)}; model and optimizer may be "
            "functions that use the trial's suggestions (a width), and a LightningEstimator's "
            "model a module built from them",
            hint="Callable[[Any], dict]",
        ),
        ParamSpec(
            "metric",
            "the history value reported to the trial after each epoch, which the pruner "
            "judges, and the trial's value without an evaluator: 'validation.loss', "
            "'train.<metric>'... (a TorchEstimator's history keys) or, for a "
            "LightningEstimator, a name the module logs ('val_loss')",
            TypeConverters.toString,
            default="validation.loss",
        ),
        ParamSpec(
            "direction",
            "whether metric is better when smaller, 'minimize', or larger, 'maximize'; "
            "the study's direction unless an evaluator says otherwise",
            TypeConverters.toString,
            default="minimize",
        ),
        ParamSpec(
            "evaluator",
            "a Spark ML Evaluator whose value on the fitted model's transform of the "
            "validation rows (the estimator's validation column) is a complete trial's "
            "value; the study then maximizes where evaluator.isLargerBetter(). Default: "
            "none (metric's last value)",
            default=None,
            hint="Any",
        ),
        ParamSpec(
            "n_trials",
            "how many trials the study holds when the search ends, those of an earlier "
            "fit of the same study included (each trial one fit)",
            to_optional_int,
            default=None,
        ),
        ParamSpec(
            "timeout",
            "seconds after which no new trial starts (the running ones finish)",
            to_optional_float,
            default=None,
        ),
        ParamSpec(
            "parallelism",
            "how many trials run at once where the cluster has the task slots for them "
            "(each trial's num_proc); the others wait in the tuner",
            TypeConverters.toInt,
            default=1,
        ),
        ParamSpec(
            "study",
            "an optuna.Study to add the trials to (its sampler, pruner, storage and "
            "direction); default: one made from study_name, sampler, pruner and storage",
            default=None,
            hint="Any",
        ),
        ParamSpec(
            "study_name",
            "the study's name: a fit finds the study of that name in storage and goes on "
            "with it. Default: a new name",
            to_optional_str,
            default=None,
        ),
        ParamSpec(
            "sampler",
            "the Optuna sampler; default: TPESampler(seed=seed). A later fit of a study "
            "holding trials uses a copy of it reseeded at random (reseed_rng)",
            default=None,
            hint="Any",
        ),
        ParamSpec(
            "pruner",
            "the Optuna pruner that stops a trial at an epoch's end; default: "
            "MedianPruner(); optuna.pruners.NopPruner() to prune nothing",
            default=None,
            hint="Any",
        ),
        ParamSpec(
            "storage",
            "where the study is kept: None (in memory), 'store' (a journal file in the "
            "estimator's store, a local or shared filesystem: studies/<study_name>.journal), "
            "an Optuna storage URL ('sqlite:///study.db', 'postgresql://...') or storage",
            default=None,
            hint="str | Any",
        ),
        ParamSpec(
            "seed",
            "the default sampler's seed: a new study with parallelism=1 gets the same trials "
            "again; a later fit of a study holding N trials seeds it seed + N, so that no "
            "trial repeats an earlier one's params",
            to_optional_int,
            default=None,
        ),
        ParamSpec(
            "verbose",
            "print one line per finished trial (its number, params, epochs, value and "
            "state) where no logging is configured for spark_estimator.tuning; the lines are "
            "logged there at INFO either way",
            TypeConverters.toBoolean,
            default=True,
        ),
    )


# The decoding params a fitted TorchModel takes from its estimator (transform decodes alike)
DECODE_PARAMS = (
    *DECODE_FUNCTIONS,
    "padding_value",
    "decode_pool",
    "decode_workers",
    "decode_device",
    "decode_timeout",
)

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
    "profiler",
    *DECODE_FUNCTIONS,
    # OptunaSearch's
    "estimator",
    "space",
    "evaluator",
    "study",
    "sampler",
    "pruner",
    "storage",
)


def json_params(instance: Params) -> dict[str, Any]:
    """The explicitly set params of ``instance`` that go into Spark ML's JSON metadata."""
    return {p.name: v for p, v in instance._paramMap.items() if p.name not in OBJECT_PARAMS}
