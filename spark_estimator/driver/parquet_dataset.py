"""Driver: describe Parquet already in the store, for the estimators' ``fit_on_parquet``.

Either a dataset folder written by ``materialize`` (``train/``, ``validation/`` and
``_meta.json``), or any folder (or file) of Parquet for training plus an optional one for
validation. Column kinds come from the Parquet schema: numbers are scalars, lists of
numbers arrays, Spark ML vector structs vectors; floats load as ``dtype``, integer labels
as int64 class indices, and so do float labels where the estimator reads class indices
(the executors refuse one that is not a whole number). Row-group sizes come from
``_meta.json`` or the files' footers.

A materialized dataset was checked when it was written (nulls, NaN, array lengths) and its
``_meta.json`` holds the array lengths, checked here against ``input_shapes``. Other Parquet
is not read on the driver, only its footers: their null counts reject nulls in scalar and
vector columns where the statistics exist. Nulls in list columns (the statistics count
empty lists too), NaN and infinite values, array lengths and ``input_shapes`` of array
columns are not checked here; the executors find nulls, varying lengths and shape
mismatches in the first batch that holds them.
"""

from __future__ import annotations

import posixpath

import pyarrow as pa
import pyarrow.parquet as pq

from ..shared.spec import IMAGE_FIELDS, ColumnSpec, DatasetInfo, column_param, row_names_column
from ..store import DatasetFolder, Store
from .data_checks import check_row_lengths
from .materialize import check_not_empty
from .validate import as_class_indices

_VECTOR_FIELDS = {"type", "size", "indices", "values"}


def _numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _hidden(path: str, folder: str) -> bool:
    """A name starting with ``.`` or ``_`` below ``folder`` (a temporary file, ``_SUCCESS``,
    ``_meta.json``): not data, as for Spark and pyarrow."""
    relative = posixpath.relpath(path, folder)
    return relative != "." and any(p.startswith((".", "_")) for p in relative.split("/"))


def list_row_groups(
    store: Store, folder: str, root: str, null_counts: dict[str, int | None] | None = None
) -> list[tuple[str, list[int]]]:
    """(path relative to ``root``, rows per row group) of every non-empty Parquet file under
    ``folder`` (or ``folder`` itself, a file), in path order.

    With ``null_counts``, also adds up the footers' null counts per Parquet column path
    (``x``, ``v.type``, ``a.list.element``); None where a row group has no such statistic.
    """
    if not store.exists(folder):
        return []
    files = []
    found = store.fs.find(folder)
    paths = [p for p in found if p.endswith(".parquet") and not _hidden(p, folder)]
    for path in sorted(paths):
        with store.fs.open(path, "rb") as f:
            meta = pq.ParquetFile(f).metadata
        groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        if sum(groups):
            files.append((posixpath.relpath(path, root), groups))
        if null_counts is not None:
            _add_null_counts(meta, null_counts)
    return files


def _add_null_counts(meta: pq.FileMetaData, counts: dict[str, int | None]) -> None:
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            chunk = group.column(c)
            stats = chunk.statistics
            known = stats is not None and stats.has_null_count
            total = counts.get(chunk.path_in_schema, 0)
            counts[chunk.path_in_schema] = (
                total + stats.null_count if known and total is not None else None
            )


def arrow_strings(schema: pa.Schema) -> set[str]:
    """The string columns of a Parquet file's ``schema``."""
    return {
        f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)
    }


def column_spec(schema: pa.Schema, name: str, role: str, dtype: str, where: str) -> ColumnSpec:
    """``role`` is feature, label or sample_weight (a float scalar)."""
    param = column_param(role)
    if name not in schema.names:
        raise ValueError(
            f"{param}: column '{name}' is not in the Parquet at {where} (columns: {schema.names})"
        )
    t = schema.field(name).type
    element = t.value_type if pa.types.is_list(t) or pa.types.is_large_list(t) else t
    integral = role == "label" and pa.types.is_integer(element)
    if _numeric(element) and (element is t or role != "sample_weight"):  # weights: scalars
        kind = "scalar" if element is t else "array"
        return ColumnSpec(name, kind, "int64" if integral else dtype)
    if role != "sample_weight" and pa.types.is_struct(t) and {f.name for f in t} == _VECTOR_FIELDS:
        return ColumnSpec(name, "vector", dtype)
    if role != "sample_weight" and (pa.types.is_string(t) or pa.types.is_large_string(t)):
        return ColumnSpec(name, "string", dtype)
    if role == "feature" and (pa.types.is_binary(t) or pa.types.is_large_binary(t)):
        return ColumnSpec(name, "binary", dtype)
    if role == "feature" and pa.types.is_struct(t) and {f.name for f in t} == set(IMAGE_FIELDS):
        return ColumnSpec(name, "image", dtype)
    expected = {
        "feature": "numbers, lists of numbers, an ML vector, binary (encoded images), strings "
        "or Spark's image struct",
        "label": "numbers, lists of numbers, an ML vector or strings",
        "sample_weight": "numbers",
    }[role]
    raise TypeError(
        f"{param}: column '{name}' in the Parquet at {where} has type {t}; expected {expected}"
    )


def _resolve(store: Store, path: str, param: str) -> str:
    full = path if path.startswith("/") else store.join(path)
    if not store.exists(full):
        raise ValueError(f"{param}: '{path}' does not exist in {store}")
    return full.rstrip("/")


def _null_counts_in_footers(
    counts: dict[str, int | None], specs: list[tuple[str, ColumnSpec]], where: str
) -> None:
    """Reject nulls the footers' statistics count exactly: scalar columns, and vectors (a
    null vector has a null ``type``). List columns are left out: empty lists count too."""
    for role, spec in specs:
        if spec.kind == "array":
            continue
        whole = spec.kind in ("scalar", "binary", "string")
        nulls = counts.get(spec.name if whole else f"{spec.name}.type")
        if nulls:
            raise ValueError(
                f"{column_param(role)}: column '{spec.name}' has {nulls} null values in the "
                f"Parquet under {where} (from the files' statistics); filter them, e.g. "
                f"df.na.drop(subset=['{spec.name}']), or fill them before writing the Parquet"
            )


def _incomplete_dataset(store: Store, root: str) -> bool:
    """A folder of ``datasets/`` without ``_meta.json``: a write in progress or interrupted."""
    return posixpath.dirname(root) == store.datasets


def parquet_dataset(
    store: Store,
    path: str,
    validation_path: str | None,
    feature_cols: list[str],
    label_cols: list[str],
    dtype: str,
    validation=None,
    sample_weight_col: str | None = None,
    input_shapes: list[list[int]] | None = None,
    class_indices: list[bool] | None = None,
) -> DatasetInfo:
    """A DatasetInfo for Parquet already in ``store``; every check runs here, on the driver.
    ``class_indices`` says per label column whether its scalars are class indices (int64),
    as ``fit`` reads them: the executors check that float ones are whole numbers."""
    root = _resolve(store, path, "path")
    meta_path = DatasetFolder(root).meta
    null_counts: dict[str, int | None] = {}
    meta = None
    if store.exists(meta_path):
        if validation_path is not None:
            raise ValueError(
                "validation_path: not allowed with a materialized dataset, which has its "
                "own validation split"
            )
        meta = DatasetInfo.from_json(root, store.read_json(meta_path), reused=True)
        files = meta.files
    elif _incomplete_dataset(store, root):
        raise ValueError(
            f"path: '{path}' is a dataset folder without _meta.json, so it is incomplete (a "
            "write in progress or interrupted) and is never read"
        )
    else:
        if validation is not None:
            raise ValueError(
                f"validation: {validation!r} splits a DataFrame in fit(); Parquet outside a "
                "materialized dataset takes its validation rows from validation_path"
            )
        folders = {"train": root}
        if validation_path is not None:
            folders["validation"] = _resolve(store, validation_path, "validation_path")
        if store.fs.isfile(root):
            root = posixpath.dirname(root)
        root = posixpath.commonpath([root] + list(folders.values()))  # a folder: root is one
        files = {
            split: list_row_groups(store, folder, root, null_counts)
            for split, folder in folders.items()
        }
    if not files.get("train"):
        raise ValueError(f"path: no Parquet files with rows under '{path}'")

    def split_specs(split: str) -> tuple[list[ColumnSpec], list[ColumnSpec], ColumnSpec | None]:
        first = files[split][0][0]
        with store.fs.open(posixpath.join(root, first), "rb") as f:
            schema = pq.read_schema(f)
        where = f"{root}/{first}"
        weight = sample_weight_col and column_spec(
            schema, sample_weight_col, "sample_weight", dtype, where
        )
        strings[split] = arrow_strings(schema)
        return (
            [column_spec(schema, c, "feature", dtype, where) for c in feature_cols],
            [column_spec(schema, c, "label", dtype, where) for c in label_cols],
            weight or None,
        )

    strings: dict[str, set[str]] = {}
    features, labels, weight = split_specs("train")
    if class_indices:
        labels = [as_class_indices(c) if i else c for c, i in zip(labels, class_indices)]
    if files.get("validation"):
        split_specs("validation")  # the validation files must hold the same columns
    data = DatasetInfo(
        path=root,
        features=features,
        labels=labels,
        files=files,
        reused=True,
        sample_weight=weight,
        row_lengths=meta.row_lengths if meta is not None else {},
        write_id=meta.write_id if meta is not None else None,
        row_names=(
            meta.row_names
            if meta is not None
            else row_names_column(
                set.intersection(*strings.values()),
                features + labels + ([weight] if weight else []),
            )
        ),
    )
    check_not_empty(data, validation_path)
    if meta is None:
        specs = [("feature", c) for c in features] + [("label", c) for c in labels]
        specs += [("sample_weight", weight)] if weight is not None else []
        where = f"'{path}'" + (f" or '{validation_path}'" if validation_path else "")
        _null_counts_in_footers(null_counts, specs, where)
    check_row_lengths(data, input_shapes)
    return data
