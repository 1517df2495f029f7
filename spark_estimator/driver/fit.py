"""Driver: the fit shared by TorchEstimator and LightningEstimator.

``fit(df)`` runs four steps: validate every input (no Spark job yet) -> materialize the
selected columns to Parquet in the store (reused when already there) -> run one barrier
job of ``num_proc`` training tasks -> build the fitted model (``_MODEL``, TorchModel) from
rank 0's result in the store.
The seconds of each step go into the model's training summary (``fit_seconds``).
Each subclass answers one hook, ``_training``, called once per fit: what its executors
train with (the pickled objects, the loop, the run manifest's fields, the callback check,
the loss probe); and names its executor loop (``_TRAINER``).
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
import warnings
from dataclasses import asdict

from pyspark.ml import Estimator, Model
from pyspark.sql import DataFrame, SparkSession

from ..shared import model_factory
from ..shared.serialization import loads, state_from_bytes
from ..shared.spec import DECODE_FUNCTIONS, DatasetInfo, TrainSpec
from ..store import Store
from . import in_place, mlflow_log, run_manifest
from .elastic import ElasticSize
from .fit_checks import Checked, FitChecks, Training, check_bucketing_data
from .fit_report import (
    FitClock,
    decoding_summary,
    log_placements,
    rank_devices,
    rank_memory,
    warn_decoding_notes,
)
from .launch import tasks_print_here
from .materialize import WriteOptions, materialize
from .monitor import console_progress_off
from .params import DECODE_PARAMS
from .parquet_dataset import parquet_dataset
from .persistence import ObjectParamsReadWrite
from .table_folders import check_not_table_folder
from .training_job import run_training_job

logger = logging.getLogger(__name__)


class StoreEstimator(FitChecks, Estimator, ObjectParamsReadWrite):
    """Base of the estimators that train through a Store; not used directly."""

    _BUNDLED: tuple[str, ...] = ()  # object params pickled together for the executors
    _REQUIRED: tuple[str, ...] = ("model", "feature_cols", "label_cols", "store")
    _TRAINER = "torch"  # the executor loop (training_task)
    # the fitted model's class: TorchModel, which the public modules above the driver name
    # (this module builds it from what the training job returns; it imports no front)
    _MODEL: type[Model]

    def setParams(self, **params):
        """Set several params at once by name, e.g. ``setParams(epochs=5, batch_size=64)``."""
        return self._set(**params)

    # -- what subclasses define ------------------------------------------------------------
    def _training(self, num_proc: int) -> Training:
        """Check the training objects and params; return what the executors train with."""
        raise NotImplementedError

    # -- fit -----------------------------------------------------------------------------
    def fit(self, dataset: DataFrame, params: dict | list[dict] | None = None):
        """Train on a DataFrame and return the fitted model.

        Every param and column is checked on the driver before any Spark job; the selected
        columns are written once to Parquet in the store (found there again by a later fit
        of the same data); one barrier job of ``num_proc`` processes trains; the fitted
        model is built from rank 0's result.

        Parameters
        ----------
        dataset : pyspark.sql.DataFrame
            The rows: the ``feature_cols``, ``label_cols`` and, where set,
            ``sample_weight_col`` and a ``validation`` column; images, text and sequences
            too (docs/images-and-text.md).
        params : dict or list of dict, optional
            Param values (``{estimator.epochs: 5}``) overriding this estimator's for this
            fit, as in any Spark ML Estimator; a list fits one model per dict.

        Returns
        -------
        TorchModel
            The trained module as a Spark ML Transformer, with ``getHistory()`` and
            ``getTrainingSummary()`` (a list of them for a list of ``params``).

        Raises
        ------
        ValueError, TypeError
            A param or column that cannot work, named in the message's first word, before
            any Spark job (bad data: before the training job); nothing in the store changes.
        TrainingError
            The training code raised on a rank: its exception and traceback, the rank's last
            output lines; the run's checkpoints stay, and a fit with the same ``run_id``
            resumes from them.
        RuntimeError
            The training job lost processes more than ``max_restarts`` times.

        Examples
        --------
        >>> net = torch.nn.Linear(3, 1)
        >>> est = TorchEstimator(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        ...                      loss=torch.nn.MSELoss(), feature_cols=["x"], label_cols=["y"],
        ...                      epochs=5, store=Store.create("/tmp/store"))
        >>> model = est.fit(df)
        >>> model.getHistory()[-1]["train"]["loss"]  # doctest: +SKIP
        """
        return super().fit(dataset, params)

    def _fit(self, dataset: DataFrame) -> Model:
        clock = FitClock()
        with console_progress_off(dataset.sparkSession):  # its bars would cross ours
            with clock("validation"):
                checked = self._validate(dataset.sparkSession, dataset)
            with clock("dataset"):
                data = self._materialize(dataset, checked)
            return self._train(dataset.sparkSession, data, checked, clock)

    def materialize(self, dataset: DataFrame) -> str:
        """Write a DataFrame's selected columns to Parquet in the store, as ``fit`` does
        first, without training.

        Parameters
        ----------
        dataset : pyspark.sql.DataFrame
            The rows, as ``fit`` takes them.

        Returns
        -------
        str
            The dataset folder in the store (found there when a fit already wrote it), for
            ``fit_on_parquet``.

        Raises
        ------
        ValueError, TypeError
            As ``fit``: a param, column or value that cannot work, named.
        """
        checked = self._validate(dataset.sparkSession, dataset, log_first=False)
        return self._materialize(dataset, checked).path

    def fit_on_parquet(
        self, path: str, validation_path: str | None = None, params: dict | None = None
    ):
        """Train on Parquet already in the store, without a DataFrame or materialization.

        Parameters
        ----------
        path : str
            A dataset folder returned by ``materialize`` (with its validation split), or a
            folder or file of Parquet rows, absolute in the store's filesystem or relative
            to its root. Columns: numbers, lists of numbers, ML vector structs, binary,
            strings or Spark's image struct; float labels are read as class indices where
            ``fit`` reads them so (``classification``, a class-index loss).
        validation_path : str, optional
            Parquet rows to validate on, beside Parquet that is not a materialized dataset
            (the ``validation`` param, which splits DataFrames, must be unset).
        params : dict, optional
            Param values overriding this estimator's for this call, as in ``fit``.

        Returns
        -------
        TorchModel
            The fitted model, as ``fit`` returns it.

        Raises
        ------
        ValueError, TypeError
            A path, param or column that cannot work, named, before the training job.
        TrainingError
            The training code raised on a rank, as in ``fit``.

        Examples
        --------
        >>> path = est.materialize(df)           # doctest: +SKIP
        >>> model = est.fit_on_parquet(path)     # doctest: +SKIP
        """
        if params:
            return self.copy(params).fit_on_parquet(path, validation_path)
        spark = SparkSession.active()
        with console_progress_off(spark):
            return self._fit_on_parquet(spark, path, validation_path)

    def _fit_on_parquet(self, spark, path: str, validation_path: str | None) -> Model:
        clock = FitClock()
        with clock("validation"):
            checked = self._validate(spark, None)
        with clock("dataset"):
            data = parquet_dataset(
                checked.store,
                path,
                validation_path,
                self.getFeatureCols(),
                self.getLabelCols(),
                self.getDtype(),
                self.getValidation(),
                self._sample_weight_col(),
                self.getInputShapes(),
                class_indices=self._class_index_labels(),
            )
        checked.training.check_callbacks(data.rows("validation") > 0)
        self._decode_spec(data.features, data.labels)  # what the Parquet's columns need
        self._probe_data(data, checked)
        return self._train(spark, data, checked, clock)

    def _materialize(self, dataset: DataFrame, checked: Checked) -> DatasetInfo:
        """The dataset the fit trains on: the DataFrame's own Parquet files, read in place
        (``data_copy``, ``in_place``), or its columns materialized to the store. A lake
        table's folder read as plain Parquet is neither (``check_not_table_folder``)."""
        check_not_table_folder(dataset, checked.store)
        if self.getDataCopy() != "always":
            data = self._in_place(dataset, checked)
            if data is not None:
                return data
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
            check=functools.partial(self._probe_data, checked=checked),
        )

    def _in_place(self, dataset: DataFrame, checked: Checked) -> DatasetInfo | None:
        """The dataset of the table's files read where they lie; None (after one INFO line
        saying why) where the DataFrame is materialized instead; with
        ``data_copy='never'`` a ValueError saying why."""
        columns = checked.features + checked.labels
        columns += [checked.sample_weight] if checked.sample_weight else []
        names = [c.name for c in columns]
        validation = self.getValidation()
        names += [validation] if isinstance(validation, str) else []
        data = (
            f"reader={self.getReader()!r} reads materialized datasets only"
            if self.getReader() != "arrow"
            else in_place.plain_scan(dataset, checked.store, names)
        )
        if isinstance(data, in_place.ParquetScan):
            scan = data
            data = in_place.in_place_dataset(
                dataset,
                scan,
                checked.store,
                checked.features,
                checked.labels,
                validation,
                self.getRandomSeed(),
                checked.sample_weight,
                self.getInputShapes(),
                self.getDtype(),
                check=functools.partial(self._probe_data, checked=checked),
            )
        if isinstance(data, str):
            if self.getDataCopy() == "never":
                raise ValueError(
                    f"data_copy: 'never', but the DataFrame cannot be read in place: {data}"
                )
            logger.info("materializing a copy of the DataFrame's columns: %s", data)
            return None
        logger.info("training on the table's own files in %s (no copy)", data.path)
        return data

    def _probe_data(self, data: DatasetInfo, checked: Checked) -> None:
        """The loss on a probe batch once the data is known: where the columns' shapes were
        not known before (``checked.probed``), and again with the class-index labels'
        smallest and largest values (``DatasetInfo.label_ranges``)."""
        probe = checked.training.probe_loss
        if probe is not None and (not checked.probed or data.label_ranges):
            probe(
                data.features,
                data.labels,
                data.sample_weight,
                row_lengths=data.row_lengths,
                transformation_fn=checked.loader.transformation_fn,
                label_ranges=data.label_ranges,
            )

    def _train(self, spark, data: DatasetInfo, checked: Checked, clock: FitClock) -> Model:
        store, training = checked.store, checked.training
        if checked.loader.decode is not None and checked.loader.decode.bucket_by_length:
            check_bucketing_data(data, checked.loader.shuffle)
        run_id, further_from = self.getRunId(), 0
        if run_id is not None:  # the rest was checked before the data (_check_run_id)
            run_manifest.check_resume_data(store, run_id, data)
            further_from = run_manifest.finished_at(store, run_id)
        else:
            run_id = f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
        run_manifest.write_manifest(
            store, run_id, {**training.manifest, **run_manifest.data_fields(data)}
        )
        spec = TrainSpec(
            bundle=training.bundle,
            data=data,
            store=store,
            run_id=run_id,
            batch_size=self.getBatchSize(),
            epochs=self.getEpochs(),
            seed=self.getRandomSeed(),
            use_gpu=checked.use_gpu,
            input_shapes=self.getInputShapes(),
            loader=checked.loader,
            loop=training.loop,
            keep_checkpoints=self.getKeepCheckpoints(),
            collective_timeout=self.getCollectiveTimeout(),
            launch_id=uuid.uuid4().hex,
            trainer=self._TRAINER,
            echo=not tasks_print_here(spark),
            further_from=further_from,
        )
        with clock("job"):
            size = ElasticSize(
                spark,
                checked.num_proc,
                self.getMinNumProc(),
                checked.start_procs,
                self.getMaxRestarts(),
                self.getElasticTimeout(),
                profile=checked.stage.profile,
            )
            summaries, resizes = run_training_job(
                spark, spec, size, self.getVerbose(), checked.stage.profile
            )
        store.write_json(store.run(run_id).ranks, [asdict(s) for s in summaries])
        digests = {s.weights_digest for s in summaries}
        if len(digests) != 1:
            raise RuntimeError(
                f"run {run_id}: ranks finished with different weights ({summaries}); "
                "the model is not the same on every rank"
            )
        log_placements(summaries)
        notes = sorted({s.device_note for s in summaries if s.device_note})
        for note in notes:
            warnings.warn(f"spark-estimator: {note}", RuntimeWarning, stacklevel=4)
        result = state_from_bytes(store.read_bytes(store.run(run_id).result))
        model = model_factory.build(loads(training.bundle)["model"])
        model.load_state_dict(result["model"], assign=model_factory.on_meta(model))
        fitted = self._MODEL(
            model=model.cpu().eval(),
            feature_cols=self.getFeatureCols(),
            input_shapes=self.getInputShapes(),
            dtype=self.getDtype(),
            output_cols=self.getOutputCols(),
            stage_level_scheduling=self.getStageLevelScheduling(),
            classification=self.getClassification(),
            probabilityCol=self.getProbabilityCol(),
            rawPredictionCol=self.getRawPredictionCol(),
            **{name: self.getOrDefault(name) for name in DECODE_PARAMS},
            feature_kinds={c.name: [c.kind, c.dtype] for c in data.features},
            fit_label_cols=self.getLabelCols(),
            feature_lengths={
                c.name: data.row_lengths[c.name]
                for c in data.features
                if c.name in data.row_lengths
            },
            history=result["history"],
            output_shapes=result["output_shapes"],
            run_id=run_id,
            training_summary={
                **result["summary"],
                "dataset_reused": data.reused,
                "dataset_in_place": data.in_place is not None,
                "resizes": resizes,
                "fit_seconds": clock.report(summaries),
                "task_resources": checked.stage.summary(),
                "rank_devices": rank_devices(summaries),
                "rank_memory": rank_memory(summaries),
                **decoding_summary(summaries),
            },
        )
        warn_decoding_notes(summaries)
        if self.getMlflowLogging():
            mlflow_log.log_fit(self, fitted, store, data)
        return fitted

    def _class_index_labels(self) -> list[bool]:
        """Per label column, whether its scalar floats are read as class indices (int64):
        none here; TorchEstimator's with classification or a class-index loss."""
        return [False] * len(self.getLabelCols())

    def _sample_weight_col(self) -> str | None:
        """The sample weight column, for estimators with that param (TorchEstimator)."""
        has = self.hasParam("sample_weight_col")
        return self.getOrDefault("sample_weight_col") if has else None

    def _run_fields(self, num_proc: int) -> dict:
        """The params every run's checkpoints depend on (see ``run_manifest``)."""
        return {
            "num_proc": num_proc,
            "batch_size": self.getBatchSize(),
            "random_seed": self.getRandomSeed(),
            "train_steps_per_epoch": self.getTrainStepsPerEpoch(),
            # the order of a pass's rows, which a resume inside a pass goes on in
            "shuffle": self.getShuffle(),
            "shuffle_buffer_size": self.getShuffleBufferSize(),
            "bucket_by_length": self.getBucketByLength(),
        }

    # -- persistence (ObjectParamsReadWrite) -----------------------------------------------
    def _objects(self) -> dict:
        # one pickle, so the optimizer still refers to the model's parameters when loaded
        return {
            name: self.getOrDefault(name)
            for name in (*self._BUNDLED, "transformation_fn", *DECODE_FUNCTIONS)
            if self.isDefined(name)
        }

    def _extra_metadata(self) -> dict:
        store = self.getStore()
        return {"store_url": store.url if store is not None else None}

    def _restore(self, objects: dict, metadata: dict) -> None:
        self._set(**objects)
        if metadata.get("store_url"):
            self._set(store=Store(metadata["store_url"]))
