"""Driver: TorchModel, the fitted Spark ML Model; transform() runs batched inference.

``transform`` adds one column per model output through ``mapInArrow`` (whole Arrow batches,
the model shipped once per task, never one row at a time): a double column for outputs of
shape [B] or [B, 1], an array<float> column otherwise; an output must have one row per
input row. On a GPU cluster whose tasks get a share of a GPU or none, its tasks run one per
executor with the executor's GPU (``stage_level_scheduling``, docs/gpu.md). The features
are cast to ``dtype``, the one the model was trained with (``fit`` sets it; a stage saved
without it loads as float32). Input columns are kept unchanged.
With ``classification`` the one output is read as class logits and becomes Spark ML's
classifier columns: ``rawPredictionCol`` and ``probabilityCol`` (ML vectors, converted from
arrays after ``mapInArrow`` with ``array_to_vector``) and the class index.

``save`` writes the module in two parts: ``weights.pt``, its state dict (loadable with
``torch.load(weights_only=True)``), and ``objects.pkl``, the module without those tensors (a
cloudpickle: ``TorchModel.load`` trusts it, see docs/security.md).
"""

from __future__ import annotations

import functools
from copy import deepcopy

import torch
from pyspark.ml import Model
from pyspark.ml.functions import array_to_vector
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, DoubleType, FloatType, StructField, StructType

from .driver import validate
from .driver.constructors import TorchModelConstructor
from .driver.params import ModelParams
from .driver.persistence import ObjectParamsReadWrite
from .driver.stage_profile import task_profile
from .driver.task_python import local_python, use_task_python
from .shared.serialization import dumps
from .shared.spec import DECODE_FUNCTIONS, FLOAT_DTYPES, ROW_NAMES, ColumnSpec, DecodeSpec
from .worker.predict import predict_batches


class TorchModel(TorchModelConstructor, Model, ModelParams, ObjectParamsReadWrite):
    """A trained torch module as a Spark ML Transformer, made by the ``fit`` of
    TorchEstimator and LightningEstimator.

    ``transform`` appends the model's outputs to a DataFrame, batch by batch on the
    executors (``mapInArrow``); with ``classification``, Spark ML's classifier columns.
    ``getHistory()`` has one dict per epoch, e.g. ``{"epoch": 1, "train": {"loss": 0.3},
    "validation": {"loss": 0.4}}``; ``getModel()`` is the trained module on CPU;
    ``getTrainingSummary()`` says how it was trained. ``save`` and ``TorchModel.load``
    persist it as any Spark ML stage (the module as ``weights.pt`` and ``objects.pkl``, a
    cloudpickle that ``load`` trusts: docs/security.md). ``copy(extra)`` keeps the uid and
    gives the copy its own module, history and summary.

    The constructor's Parameters section (``help(TorchModel.__init__)``) lists its params;
    a param given as None is left unset (at its default).

    Examples
    --------
    >>> model = est.fit(df)                                             # doctest: +SKIP
    >>> model.getHistory()[-1]                                          # doctest: +SKIP
    {'epoch': 5, 'train': {'loss': 0.02}, 'validation': {'loss': 0.03}}
    >>> scored = model.transform(df)                                    # doctest: +SKIP
    >>> model.save("/tmp/model")                                        # doctest: +SKIP
    >>> same = TorchModel.load("/tmp/model")                            # doctest: +SKIP
    >>> TorchModel(model=net, feature_cols=["x"]).transform(df)         # doctest: +SKIP
    """

    _NOT_PARAMS = (
        "history",
        "output_shapes",
        "run_id",
        "training_summary",
        "feature_kinds",
        "fit_label_cols",
        "feature_lengths",
    )

    def _init_keywords(self, keywords: dict) -> None:
        """Sets the params given, and keeps what fit hands the model (``KEYWORDS``)."""
        state = {k: keywords.pop(k, None) for k in self._NOT_PARAMS}
        self._set(**{k: v for k, v in keywords.items() if v is not None})
        self._history = list(state["history"] or [])
        self._output_shapes = state["output_shapes"]
        self._run_id = state["run_id"]
        self._training_summary = dict(state["training_summary"] or {})
        # column -> [kind, dtype] fit trained it as, where the schema alone cannot tell:
        # arrays of varying length are "sequence"s (padded, a mask after them)
        self._feature_kinds = dict(state["feature_kinds"] or {})
        self._fit_label_cols = list(state["fit_label_cols"] or [])
        # column -> values per row of an array or vector column fit read (not sequences)
        self._feature_lengths = dict(state["feature_lengths"] or {})

    def copy(self, extra=None) -> TorchModel:
        """A copy with the same uid and the ``extra`` params (a dict Param -> value). It
        holds deep copies of the module (unless ``extra`` sets ``model``), the history and
        the training summary, so changing one model never changes the other."""
        that = super().copy(extra)
        if self.isDefined("model") and that.getModel() is self.getModel():
            that._set(model=deepcopy(self.getModel()))
        that._history = deepcopy(self._history)
        that._output_shapes = deepcopy(self._output_shapes)
        that._training_summary = deepcopy(self._training_summary)
        that._feature_kinds = dict(self._feature_kinds)
        that._fit_label_cols = list(self._fit_label_cols)
        that._feature_lengths = dict(self._feature_lengths)
        return that

    def getTrainingSummary(self) -> dict:
        """How the model was trained: processes, learning rates used (after ``lr_scaling``),
        accumulation, compression, precision, epochs run, whether training stopped early,
        which epoch's weights this model holds (``selected_epoch``; with a BestModel
        callback, ``selection`` says by which metric) and which checkpoints were kept."""
        return dict(self._training_summary)

    def getHistory(self) -> list[dict]:
        """Per-epoch training and validation metrics, averaged across ranks."""
        return list(self._history)

    def getRunId(self) -> str | None:
        """The run folder in the store that produced this model (None if not from a fit)."""
        return self._run_id

    def getOutputShapes(self) -> list[list[int]] | None:
        """Each model output's shape without the batch dimension, as seen in training."""
        return self._output_shapes

    def _output_names(self) -> list[str]:
        if self.getOutputCols():
            return self.getOutputCols()
        if self._output_shapes and len(self._output_shapes) > 1:
            return [f"prediction_{i}" for i in range(len(self._output_shapes))]
        return ["prediction"]

    def transform(self, dataset: DataFrame, params: dict | None = None) -> DataFrame:
        """The DataFrame with the model's outputs appended, computed on whole Arrow batches.

        Parameters
        ----------
        dataset : pyspark.sql.DataFrame
            Rows holding the ``feature_cols`` (of the types the model was fit on; images,
            text and sequences are decoded as in validation, without augmentation). Every
            column is kept unchanged.
        params : dict, optional
            Param values (``{model.output_cols: ["score"]}``) for this call.

        Returns
        -------
        pyspark.sql.DataFrame
            ``dataset`` plus one column per model output (``output_cols``; a double for
            outputs of shape [B] or [B, 1], else array<float>), or with ``classification``
            the prediction, ``probabilityCol`` and ``rawPredictionCol`` of Spark ML's
            classifiers. Lazy, as any transformation: the model runs when it is read.
            NaN and infinite feature values are not refused: a row whose class logits are
            not finite gets prediction NaN, and the executors log a warning naming the
            columns (docs/bad-input.md).

        Raises
        ------
        ValueError, TypeError
            A missing or mistyped feature column, or an output column that exists already,
            named before any Spark job.

        Examples
        --------
        >>> scored = model.transform(df)                                # doctest: +SKIP
        >>> scored.select("prediction").show(3)                         # doctest: +SKIP
        """
        return super().transform(dataset, params)

    def _transform(self, dataset: DataFrame) -> DataFrame:
        fields, options = self._prediction(dataset.schema)
        self._check_decode_device(dataset.sparkSession, options["decode"], options["features"])
        use_task_python(dataset.sparkSession)  # the driver's Python on a local master
        out = self._map_batches(dataset, fields, options)
        if not self.getClassification():
            return out
        raw, prob, _ = options["output_cols"]
        return out.withColumns({c: array_to_vector(_col(c)) for c in (raw, prob)})

    def _prediction(self, schema: StructType) -> tuple[list[StructField], dict]:
        """The columns the model appends to rows of ``schema`` (with ``classification``,
        raw and probability as arrays of doubles: ``transform`` makes them vectors), and
        the keyword arguments of ``predict_batches`` for them but the model; also what the
        MLflow model's ``predict`` runs (spark_estimator.pyfunc). Raises on a missing or
        mistyped feature column and on output columns that cannot be added, naming them."""
        if not self.isDefined("model") or not self.isDefined("feature_cols"):
            raise ValueError("model, feature_cols: a TorchModel needs both to transform")
        dtype = self.getDtype()
        validate.check_choice("dtype", dtype, FLOAT_DTYPES)
        features = [
            self._as_trained(validate.column_spec(schema, c, "feature", dtype))
            for c in self.getFeatureCols()
        ]
        validate.check_input_shapes(self.getInputShapes(), self.getFeatureCols(), features)
        decode = validate.decode_spec(self, features, [])
        if self.getClassification():
            fields, scalar = self._class_fields(schema), []
        else:
            fields, scalar = self._output_fields(schema)
        names = ROW_NAMES if ROW_NAMES in schema.names else None
        return fields, {
            "features": features,
            "input_shapes": self.getInputShapes(),
            "output_cols": [f.name for f in fields],
            "scalar_outputs": scalar,
            "classification": self.getClassification(),
            "decode": decode,
            "row_names": names if any(c.variable for c in features) else None,
            "fit_labels": self._fit_label_cols,
        }

    def _output_fields(self, schema: StructType) -> tuple[list[StructField], list[bool]]:
        """One column per model output: a double for outputs of shape [] or [1], else
        array<float>; and which are doubles."""
        names = self._output_names()
        validate.check_output_cols(names, schema.names)
        if self._output_shapes is not None and len(self._output_shapes) != len(names):
            raise ValueError(
                f"output_cols: {names} name {len(names)} columns but the model has "
                f"{len(self._output_shapes)} outputs"
            )
        scalar = [
            self._output_shapes is not None and shape in ([], [1])
            for shape in (self._output_shapes or [None] * len(names))
        ]
        fields = [
            StructField(n, DoubleType() if s else ArrayType(FloatType(), False), False)
            for n, s in zip(names, scalar)
        ]
        return fields, scalar

    def _check_decode_device(self, spark, decode: DecodeSpec, features: list[ColumnSpec]) -> None:
        """``decode_device='cuda'`` needs a GPU in transform's tasks (and, on a local master,
        torchvision's decoder in this Python)."""
        if decode.device != "cuda" or not any(c.variable for c in features):
            return
        stage = task_profile(spark, self.getStageLevelScheduling(), job="transform")
        validate.check_decode_device(
            decode.device,
            validate.check_use_gpu(spark, "auto", stage),
            "transform's tasks get no GPU here "
            f"({' and '.join(validate.GPU_AMOUNTS)} are not set): "
            "model.setDecodeDevice('cpu') decodes them on the CPU",
            local_python(spark),
        )

    def _as_trained(self, spec: ColumnSpec) -> ColumnSpec:
        """An array column fit read as a sequence (its lengths varied) is one here too, its
        values in the dtype fit gave them (token ids: int64)."""
        kind, dtype = self._feature_kinds.get(spec.name, [spec.kind, spec.dtype])
        if spec.kind == "array" and kind == "sequence":
            return ColumnSpec(spec.name, "sequence", dtype)
        return spec

    def _class_fields(self, schema: StructType) -> list[StructField]:
        """``classification``: the logits and probabilities as arrays of doubles (mapInArrow
        writes them so; ``transform`` then makes them ML vectors with ``array_to_vector``, a
        projection) and the class index."""
        raw, prob, pred = validate.classification_cols(
            self.getOutputCols(), self.getProbabilityCol(), self.getRawPredictionCol()
        )
        validate.check_class_output_shapes(self._output_shapes)
        params = ("rawPredictionCol", "probabilityCol", "output_cols")
        for param, name in zip(params, (raw, prob, pred)):
            if name in schema.names:
                raise ValueError(f"{param}: column '{name}' already exists in the DataFrame")
        doubles = ArrayType(DoubleType(), False)
        return [
            StructField(raw, doubles, False),
            StructField(prob, doubles, False),
            StructField(pred, DoubleType(), False),
        ]

    def _map_batches(self, dataset: DataFrame, fields: list[StructField], options: dict):
        """``dataset`` with the columns ``fields`` appended by ``predict_batches`` (given
        ``options``); on a GPU cluster whose tasks get less than a whole GPU, with a task
        resource profile of one GPU and an executor's cores (``stage_level_scheduling``)."""
        stage = task_profile(dataset.sparkSession, self.getStageLevelScheduling(), job="transform")
        profile = {} if stage.profile is None else {"profile": stage.profile}
        predict = functools.partial(
            predict_batches, model_bytes=dumps(self.getModel(), "model"), **options
        )
        schema = StructType(list(dataset.schema.fields) + fields)
        return dataset.mapInArrow(predict, schema, **profile)

    # -- persistence (ObjectParamsReadWrite) -----------------------------------------------
    def _objects(self) -> dict:
        names = ("model", *DECODE_FUNCTIONS)
        return {n: self.getOrDefault(n) for n in names if self.isDefined(n)}

    def _weights(self) -> dict | None:
        """The module's parameters and buffers by state-dict name: saved to ``weights.pt``
        (weights-only loadable) and left out of the model's pickle."""
        module = self.getModel() if self.isDefined("model") else None
        if not isinstance(module, torch.nn.Module):
            return None
        own = {id(t) for t in (*module.parameters(), *module.buffers())}
        state = module.state_dict(keep_vars=True)
        return {k: t for k, t in state.items() if id(t) in own}  # not what hooks made

    def _extra_metadata(self) -> dict:
        return {
            "history": self._history,
            "output_shapes": self._output_shapes,
            "run_id": self._run_id,
            "training_summary": self._training_summary,
            "feature_kinds": self._feature_kinds,
            "fit_label_cols": self._fit_label_cols,
            "feature_lengths": self._feature_lengths,
        }

    def _restore(self, objects: dict, metadata: dict) -> None:
        self._set(**objects)
        self._history = metadata.get("history") or []
        self._output_shapes = metadata.get("output_shapes")
        self._run_id = metadata.get("run_id")
        self._training_summary = metadata.get("training_summary") or {}
        self._feature_kinds = metadata.get("feature_kinds") or {}
        self._fit_label_cols = metadata.get("fit_label_cols") or []
        self._feature_lengths = metadata.get("feature_lengths") or {}


def _col(name: str):
    """The column called ``name``, even with dots or backticks in it."""
    return F.col("`" + name.replace("`", "``") + "`")
