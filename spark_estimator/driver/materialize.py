"""Driver: write the selected columns of a DataFrame to Parquet datasets in the store.

One Spark write produces the train and validation rows together (partitioned by a split
column), so the two are complementary even when the source is not deterministic. Columns
are converted column-wise by Spark: vectors (dense or sparse) to arrays, features and float
labels to ``dtype``, integral labels to int64 (class indices); labels read as class indices
that the DataFrame holds as floats (StringIndexer's) are counted and cast by the writer.
The rows are repartitioned into ``num_files`` partitions, and each partition is written by
its executor with pyarrow through the store's fsspec filesystem
(``write_partition``, run by ``mapInArrow``): at most ``num_files`` files per
split, row groups of about ``row_group_bytes``, each file moved into place only when
complete. Spark's own writer is not used, so any fsspec store works with its
``storage_options`` alone (no Hadoop connector or configuration), and the driver needs no
SparkContext (Spark Connect). The executors return each file's row-group sizes, so no
footer is read back.

The same write checks the converted values: each executor counts them in the Arrow
batches it writes (``column_stats``; no extra pass over the data) and returns
the counts with its files: nulls in every column (null rows, and null elements inside
arrays), NaN and +-inf in features and float labels, and arrays of one length per column,
whose lengths are also checked against ``input_shapes`` (see ``check_row_lengths``). A failed
check raises on the driver before the training job starts.

Each write goes to its own folder, ``datasets/<key>/<write-id>``, which no other fit ever
writes or removes. ``datasets/<key>/_meta.json`` (row counts and row-group sizes per file,
row lengths, and what the key was computed from) is written last, atomically, and names the
complete write; a dataset whose ``_meta.json`` exists is complete and is reused by any later
fit, in any session, with the same key (see ``cache_key``). Fits of one driver that need
the same key at once write it once (``one_writer``); two drivers writing the same key
at once both end with a complete dataset: the one that finds ``_meta.json`` already there
drops its own write and uses the published one; if both publish, the last ``_meta.json``
wins and the other write stays, unnamed but intact, for the fit that is reading it.

A key holds only where the rows have an identity that outlives the Spark application
(files, local rows: ``cache_key``); rows from a Python list or an RDD are keyed with the
application's id. So the write also takes a digest of its rows' content (``row_digest``:
each row's hash of its written values, summed; no other pass), kept in ``_meta.json``'s
``source``. The first dataset written of some rows is indexed by that digest with the
columns, split and write options (``Store.rows_index``); a later write of equal rows under
another key (a new driver's) drops its own files and uses that first copy, its split
included (a fraction's per-row draws depend on the partitioning, so a second copy could
split otherwise), and records its key as an alias of it (``Store.key_alias``), so the next
fit of that key reads it without writing. A new driver on the same rows thus trains on the
same dataset, under the same key, and resumes its runs (``run_manifest``).
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass

from pyspark.ml.functions import vector_to_array
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import IntegralType, StringType

from ..shared.column_stats import check_observed, merge_stats
from ..shared.row_digest import HASH_COL, content_digest
from ..shared.spec import SPLITS, ColumnSpec, DatasetInfo, row_names_column
from ..store import DatasetFolder, Store
from ..worker.data.parquet_writer import WRITTEN_SCHEMA, ParquetTarget, write_partition
from .cache_key import cache_key, one_writer, source_fingerprint
from .data_checks import (
    check_dataset,
    checked_columns,
    counted_columns,
    label_ranges,
)
from .validate import sequence_element_integral

SPLIT_COL = "__spark_estimator_split"
COMPRESSIONS = ("uncompressed", "snappy", "gzip", "zstd")


@dataclass(frozen=True)
class WriteOptions:
    """How the Parquet is laid out; part of the cache key."""

    num_files: int  # Spark partitions written, each at most one file per split
    row_group_bytes: int  # about this much uncompressed Arrow data per row group
    compression: str


def _select_expr(
    spec: ColumnSpec, from_floats: frozenset[str] = frozenset(), integers: bool = False
) -> Column:
    """The column as written: converted column-wise by Spark (see the module); variable
    columns as they are; arrays of ``integers`` as bigint (token ids, if their lengths
    vary; the loader casts fixed-length ones to ``dtype``)."""
    if spec.variable:
        return F.col(spec.name)
    element = "bigint" if spec.integral else ("double" if spec.dtype == "float64" else "float")
    if spec.name in from_floats:  # class indices as floats: the writer counts and casts them
        element = "double"
    if spec.kind == "array" and integers:
        element = "bigint"
    if spec.kind == "vector":  # vector_to_array fails on a null vector: keep it null
        column = F.col(spec.name)
        converted = vector_to_array(column, spec.dtype)
        return F.when(column.isNotNull(), converted).alias(spec.name)
    target = f"array<{element}>" if spec.kind == "array" else element
    return F.col(spec.name).cast(target).alias(spec.name)


def _split_expr(validation, seed: int) -> Column:
    if validation is None:
        return F.lit("train")
    if isinstance(validation, str):  # a boolean or 0/1 column; null counts as training
        is_val = F.coalesce(F.col(validation).cast("boolean"), F.lit(False))
    else:
        is_val = F.rand(seed) < validation
    return F.when(is_val, F.lit("validation")).otherwise(F.lit("train"))


def materialize(
    df: DataFrame,
    store: Store,
    features: list[ColumnSpec],
    labels: list[ColumnSpec],
    validation,
    seed: int,
    options: WriteOptions,
    sample_weight: ColumnSpec | None = None,
    input_shapes: list[list[int]] | None = None,
    check: Callable[[DatasetInfo], None] | None = None,
) -> DatasetInfo:
    """Write (or reuse) the Parquet datasets for this DataFrame and these columns, checking
    the values on the way (see the module's docstring); ``check`` (the loss on a probe
    batch) raises, for the dataset found or written, before one is published."""
    source = source_fingerprint(df)
    row_names = _row_names(df, features + labels)
    key = cache_key(
        source, features + labels, validation, seed, asdict(options), sample_weight, row_names
    )
    with one_writer(store.url, key):
        return _find_or_write(
            df,
            store,
            key,
            source,
            row_names,
            features,
            labels,
            validation,
            seed,
            options,
            sample_weight,
            input_shapes,
            check,
        )


def _find_or_write(
    df: DataFrame,
    store: Store,
    key: str,
    source: dict,
    row_names: str | None,
    features: list[ColumnSpec],
    labels: list[ColumnSpec],
    validation,
    seed: int,
    options: WriteOptions,
    sample_weight: ColumnSpec | None,
    input_shapes: list[list[int]] | None,
    check: Callable[[DatasetInfo], None] | None,
) -> DatasetInfo:
    """``materialize`` for the dataset of ``key``: the one in the store, or written."""
    dataset = store.dataset(key)
    if (found := _published(store, key)) is not None:
        check_dataset(found, input_shapes, check)
        return found

    write_id = f"write-{uuid.uuid4().hex}"
    columns = checked_columns(features, labels, sample_weight)
    from_floats = frozenset(
        c.name
        for c in labels
        if c.kind == "scalar"
        and c.integral
        and not isinstance(df.schema[c.name].dataType, IntegralType)
    )
    integers = {c.name for c in features + labels if sequence_element_integral(df.schema, c.name)}
    names = [F.col(row_names)] if row_names else []
    requested = features + labels  # as the key has them (before ragged arrays are sequences)
    try:
        selected = df.select(
            *[_select_expr(c, from_floats, c.name in integers) for _, c in columns],
            *names,
            _split_expr(validation, seed).alias(SPLIT_COL),
        )
        selected = selected.withColumn(HASH_COL, _row_hash(selected.columns, validation))
        target = ParquetTarget(
            store,
            dataset,
            write_id,
            SPLIT_COL,
            options.row_group_bytes,
            options.compression,
            counted_columns(columns, from_floats),
            hashed=True,
        )
        written = (
            selected.repartition(options.num_files)
            .mapInArrow(functools.partial(write_partition, target=target), WRITTEN_SCHEMA)
            .collect()
        )
        metrics: dict[str, int] = {}
        for row in written:
            metrics = merge_stats(metrics, json.loads(row.stats))
        row_lengths, ragged = check_observed(metrics, columns)
        features, labels = (
            [as_sequence(c, c.name in integers) if c.name in ragged else c for c in specs]
            for specs in (features, labels)
        )
        data = DatasetInfo(
            path=dataset.path,
            features=features,
            labels=labels,
            files=_files_by_split(written),
            source={
                **source,
                "files": len(source.get("files", [])),
                "key": key,
                "content": content_digest(metrics),
            },
            sample_weight=sample_weight,
            row_lengths=row_lengths,
            write_id=write_id,
            label_ranges=label_ranges(metrics, columns),
            row_names=row_names,
        )
        check_not_empty(data, validation)
        rows_key = cache_key(
            {"content": data.source["content"]},
            requested,
            validation,
            seed,
            asdict(options),
            sample_weight,
            row_names,
        )
        # another fit finished the same dataset first, or these rows were written before
        found = _published(store, key) or _first_copy(store, rows_key)
        check_dataset(found or data, input_shapes, check)
    except BaseException:
        _discard(store, dataset, write_id)
        raise
    if found is not None:
        _discard(store, dataset, write_id)  # never read by anyone: this call has not published it
        if found.source.get("key", key) != key:  # the same rows under another key: found again
            store.write_json(store.key_alias(key), {"key": found.source["key"]})
        return found
    store.write_json(dataset.meta, data.to_json())  # atomic; the last of two racing fits wins
    store.write_json(store.rows_index(rows_key), {"key": key})
    return data


def _row_hash(names: list[str], validation) -> Column:
    """Each row's 64-bit hash of its written values (``row_digest``): the columns in
    order, and the split only where a validation column decides it (a fraction's split is
    a draw, which the first copy of the rows keeps: see the module)."""
    hashed = [n for n in names if n != SPLIT_COL or isinstance(validation, str)]
    return F.xxhash64(*[F.col(n) for n in hashed])


def _published(store: Store, key: str) -> DatasetInfo | None:
    """The complete dataset of ``key`` (its ``_meta.json``), or of the key whose rows the
    write of ``key`` turned out to hold (``Store.key_alias``); None when neither is."""
    dataset = store.dataset(key)
    if store.exists(dataset.meta):
        return DatasetInfo.from_json(dataset.path, store.read_json(dataset.meta), reused=True)
    alias = store.key_alias(key)
    if store.exists(alias):
        other = store.dataset(store.read_json(alias)["key"])
        if store.exists(other.meta):
            return DatasetInfo.from_json(other.path, store.read_json(other.meta), reused=True)
    return None


def _first_copy(store: Store, rows_key: str) -> DatasetInfo | None:
    """The complete dataset first written of the rows of ``rows_key`` (their content
    digest, columns, split and write options: ``Store.rows_index``), if still there."""
    index = store.rows_index(rows_key)
    if not store.exists(index):
        return None
    first = store.dataset(store.read_json(index)["key"])
    if not store.exists(first.meta):  # removed since: the new write takes its place
        return None
    return DatasetInfo.from_json(first.path, store.read_json(first.meta), reused=True)


def _row_names(df: DataFrame, columns: list[ColumnSpec]) -> str | None:
    """The column naming each row (binaryFile's ``path``), written beside variable columns
    so that a row that fails to decode is named; None without one or without those."""
    strings = {f.name for f in df.schema.fields if isinstance(f.dataType, StringType)}
    return row_names_column(strings, columns)


def as_sequence(spec: ColumnSpec, integers: bool) -> ColumnSpec:
    """An array column whose lengths vary, read as a sequence: padded per batch; integers
    (token ids) stay int64."""
    return ColumnSpec(spec.name, "sequence", "int64" if integers else spec.dtype)


def _files_by_split(written: list) -> dict[str, list[tuple[str, list[int]]]]:
    """The executors' rows (split, path, row groups) as DatasetInfo.files, in path order,
    which is the partitions' order."""
    return {
        split: sorted((row.path, list(row.row_groups)) for row in written if row.split == split)
        for split in SPLITS
    }


def _discard(store: Store, dataset: DatasetFolder, write_id: str) -> None:
    """Remove this call's own write folder (only this call writes or removes it), and the
    dataset folder if that left it empty (``rmdir`` refuses a folder another fit is writing
    into)."""
    store.remove(dataset.write(write_id))
    try:
        store.fs.rmdir(dataset.path)
    except (OSError, NotImplementedError):  # not empty, or already gone
        pass


def check_not_empty(data: DatasetInfo, validation) -> None:
    if data.rows("train") == 0:
        raise ValueError(
            "DataFrame: no training rows"
            + (" (every row went to validation)" if data.rows("validation") else "")
        )
    if validation is not None and data.rows("validation") == 0:
        raise ValueError(
            f"validation: the split {validation!r} selected no validation rows; use a larger "
            "fraction or mark some rows in the validation column"
        )
