"""Driver: write the selected columns of a DataFrame to Parquet datasets in the store.

One Spark write produces the train and validation rows together (partitioned by a split
column), so the two are complementary even when the source is not deterministic. Columns
are converted column-wise by Spark: vectors (dense or sparse) to arrays, features and float
labels to ``dtype``, integral labels to int64 (class indices). The rows are repartitioned
into ``num_files`` files per split with row groups of about ``row_group_bytes``.

The result is moved into ``datasets/<key>`` only when complete, with ``_meta.json`` (row
counts and row-group sizes per file, and what the key was computed from) written last; a
dataset whose ``_meta.json`` exists is complete and is reused by any later fit, in any
session, with the same key (see ``cache_key.py``).
"""

from __future__ import annotations

import posixpath
from dataclasses import asdict, dataclass

import pyarrow.parquet as pq
from pyspark.ml.functions import vector_to_array
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from ..spec import SPLITS, ColumnSpec, DatasetInfo
from ..store import Store
from .cache_key import cache_key, source_fingerprint

SPLIT_COL = "__spark_estimator_split"
COMPRESSIONS = ("uncompressed", "snappy", "gzip", "zstd")


@dataclass(frozen=True)
class WriteOptions:
    """How the Parquet is laid out; part of the cache key."""

    num_files: int  # files per split (one Spark partition each)
    row_group_bytes: int  # Parquet's parquet.block.size
    compression: str


def _select_expr(spec: ColumnSpec) -> Column:
    element = "bigint" if spec.integral else ("double" if spec.dtype == "float64" else "float")
    if spec.kind == "vector":
        return vector_to_array(F.col(spec.name), spec.dtype).alias(spec.name)
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


def list_row_groups(store: Store, folder: str, root: str) -> list[tuple[str, list[int]]]:
    """(path relative to ``root``, rows per row group) of every non-empty Parquet file."""
    if not store.exists(folder):
        return []
    files = []
    paths = [p for p in store.fs.find(folder) if p.endswith(".parquet")]
    for path in sorted(paths):
        with store.fs.open(path, "rb") as f:
            meta = pq.ParquetFile(f).metadata
        groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        if sum(groups):
            files.append((posixpath.relpath(path, root), groups))
    return files


def materialize(
    df: DataFrame,
    store: Store,
    features: list[ColumnSpec],
    labels: list[ColumnSpec],
    validation,
    seed: int,
    options: WriteOptions,
    sample_weight: ColumnSpec | None = None,
) -> DatasetInfo:
    """Write (or reuse) the Parquet datasets for this DataFrame and these columns."""
    source = source_fingerprint(df)
    key = cache_key(source, features + labels, validation, seed, asdict(options), sample_weight)
    final = store.dataset_path(key)
    meta_path = posixpath.join(final, "_meta.json")
    if store.exists(meta_path):
        return DatasetInfo.from_json(final, store.read_json(meta_path), reused=True)

    tmp = store.new_temp_dir(store.join("datasets"))
    try:
        selected = df.select(
            *[_select_expr(c) for c in features + labels + [sample_weight] if c is not None],
            _split_expr(validation, seed).alias(SPLIT_COL),
        ).repartition(options.num_files)
        (
            selected.write.partitionBy(SPLIT_COL)
            .option("compression", options.compression)
            .option("parquet.block.size", options.row_group_bytes)
            .parquet(store.spark_url(tmp))
        )
        for split in SPLITS:
            written = posixpath.join(tmp, f"{SPLIT_COL}={split}")
            if store.exists(written):
                store.move(written, posixpath.join(tmp, split))
        data = DatasetInfo(
            path=final,
            features=features,
            labels=labels,
            files={s: list_row_groups(store, posixpath.join(tmp, s), tmp) for s in SPLITS},
            source={**source, "files": len(source.get("files", [])), "key": key},
            sample_weight=sample_weight,
        )
        check_not_empty(data, validation)
        store.write_json(posixpath.join(tmp, "_meta.json"), data.to_json())
        if store.exists(meta_path):  # another fit finished the same dataset first
            store.remove(tmp)
        else:
            store.remove(final)  # an incomplete leftover without _meta.json
            store.move(tmp, final)
    except BaseException:
        store.remove(tmp)
        raise
    return data


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
