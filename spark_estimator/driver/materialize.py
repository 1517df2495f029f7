"""Driver: write the selected columns of a DataFrame to Parquet datasets in the store.

One Spark write, partitioned by a split column, produces the train and validation rows
together, so the two are complementary even when the source is not deterministic. Vectors
become float32 arrays, features float32, integral labels int64 (class indices), other
labels float32. The result is moved into ``datasets/<key>`` only when complete, with
``_meta.json`` (row counts and row-group sizes per file) written last; a dataset whose
``_meta.json`` exists is complete and is reused by later fits with the same key.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from dataclasses import asdict

import pyarrow.parquet as pq
from pyspark.ml.functions import vector_to_array
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from ..spec import DATASET_FORMAT_VERSION, SPLITS, ColumnSpec, DatasetInfo
from ..store import Store

SPLIT_COL = "__spark_estimator_split"


def _plan_fingerprint(df: DataFrame) -> str:
    """A string equal for DataFrames with the same logical plan over the same data."""
    parts = [str(df.semanticHash()), df.schema.json()]
    jdf = getattr(df, "_jdf", None)  # absent on Spark Connect
    if jdf is not None:
        parts.append(jdf.queryExecution().analyzed().canonicalized().toString())
    return "\n".join(parts)


def cache_key(df: DataFrame, features, labels, validation, seed: int) -> str:
    spec = {
        "version": DATASET_FORMAT_VERSION,
        "plan": _plan_fingerprint(df),
        "columns": [asdict(c) for c in features + labels],
        "validation": validation,
        "seed": seed if isinstance(validation, float) else None,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:24]


def _select_expr(spec: ColumnSpec) -> Column:
    if spec.kind == "vector":
        return vector_to_array(F.col(spec.name), "float32").alias(spec.name)
    element = "bigint" if spec.integral else "float"
    target = f"array<{element}>" if spec.kind == "array" else element
    return F.col(spec.name).cast(target).alias(spec.name)


def _split_expr(validation, seed: int) -> Column:
    if validation is None:
        return F.lit("train")
    is_val = F.col(validation) if isinstance(validation, str) else F.rand(seed) < validation
    return F.when(is_val, F.lit("validation")).otherwise(F.lit("train"))


def _list_row_groups(store: Store, root: str, split: str) -> list[tuple[str, list[int]]]:
    folder = posixpath.join(root, split)
    if not store.exists(folder):
        return []
    files = []
    for path in sorted(store.fs.glob(posixpath.join(folder, "*.parquet"))):
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
) -> DatasetInfo:
    """Write (or reuse) the Parquet datasets for this DataFrame and these columns."""
    key = cache_key(df, features, labels, validation, seed)
    final = store.dataset_path(key)
    meta_path = posixpath.join(final, "_meta.json")
    if store.exists(meta_path):
        return DatasetInfo.from_json(final, store.read_json(meta_path), reused=True)

    tmp = store.new_temp_dir(store.join("datasets"))
    try:
        selected = df.select(
            *[_select_expr(c) for c in features + labels],
            _split_expr(validation, seed).alias(SPLIT_COL),
        )
        selected.write.partitionBy(SPLIT_COL).parquet(store.spark_url(tmp))
        for split in SPLITS:
            written = posixpath.join(tmp, f"{SPLIT_COL}={split}")
            if store.exists(written):
                store.move(written, posixpath.join(tmp, split))
        data = DatasetInfo(
            path=final,
            features=features,
            labels=labels,
            files={s: _list_row_groups(store, tmp, s) for s in SPLITS},
        )
        _check_not_empty(data, validation)
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


def _check_not_empty(data: DatasetInfo, validation) -> None:
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
