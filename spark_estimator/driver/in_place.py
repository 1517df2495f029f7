"""Driver: a DataFrame that is a plain scan of Parquet files, trained on where they lie.

Most training data already is Parquet: a lake table, an ETL job's output. When ``fit``'s
DataFrame only reads such files (``spark.read.parquet``, a table over Parquet files;
selecting columns, renaming none of them, casting numbers to float or double as the
loader does per batch anyway), every selected column has a type the
loader reads, and the files are on the store's filesystem, the ranks read the files
themselves: nothing is written under ``datasets/``. What a fit learns of the table (its
files' row groups, each row group's rows of either split, the value checks) is kept in
``tables/<key>.json``, keyed like a materialized dataset by the plan, the columns, the
split and every file's size and modification time, so a changed table is new data, a
re-fit finds it, and a run resumed over changed files is refused (its data differs).

The split is not written either: each row's split is a function of the row
(``RowSplit``: a seeded draw from its index in the table, or the validation column), so it
is deterministic and complementary as a materialized split is. The checks the write makes
(nulls, NaN and infinite values, array lengths, class-index values) are counted in one
Spark job that reads the row groups with pyarrow and writes nothing
(``count_row_groups``), or taken from the files' statistics where those suffice (integer
columns only, without a validation column). Anything else is materialized as before, and
``plain_scan`` says why (logged once at INFO by the fit). ``data_copy`` forces either way.
"""

from __future__ import annotations

import functools
import json
import math
import posixpath
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import DataFrame

from ..shared.column_stats import check_observed, merge_stats
from ..shared.row_split import RowSplit
from ..shared.spec import ColumnSpec, DatasetInfo, InPlace, row_names_column
from ..store import Store, spark_url
from ..worker.data.table_stats import COUNTED_SCHEMA, TableCounts, count_row_groups
from .cache_key import FILE_STATUS, cache_key, one_writer, source_fingerprint
from .data_checks import check_dataset, checked_columns, counted_columns
from .data_checks import label_ranges as counted_label_ranges
from .launch import is_connect
from .materialize import as_sequence, check_not_empty
from .parquet_dataset import arrow_strings
from .parquet_dataset import column_spec as parquet_column_spec
from .validate import sequence_element_integral

DATA_COPIES = ("auto", "always", "never")  # data_copy's values
# above this much (the read columns, uncompressed) the checks the files' statistics settle
# are not counted again in a pass before the job: the ranks check the rest as they read
CHECK_PASS_BYTES = 64 * 2**20
_PASS_THROUGH = {"Project", "SubqueryAlias"}
# object stores named as Spark's Hadoop connectors name them, and as fsspec does
HADOOP_PROTOCOLS = {"s3a": "s3", "s3n": "s3", "gs": "gcs", "abfss": "abfs"}


@dataclass(frozen=True)
class ParquetScan:
    """The Parquet files a plain scan reads: their folder on the store's filesystem, and
    each file's path below it, size and modification time, in path order."""

    root: str
    files: tuple[tuple[str, int, int], ...]


def _items(seq) -> list:
    """A Scala collection's items (through the JVM gateway)."""
    it, out = seq.iterator(), []
    while it.hasNext():
        out.append(it.next())
    return out


def _leaf(analyzed, names: list[str]):
    """The plan's one leaf when the nodes above it only select columns; else why not."""
    node = analyzed
    while True:
        kind = node.getClass().getSimpleName()
        if kind == "LogicalRelation":
            return node
        if not _items(node.children()):
            return f"it reads a {kind}, not Parquet files"
        if kind not in _PASS_THROUGH:
            return f"the DataFrame's plan has a {kind} (only selecting columns is read in place)"
        if kind == "Project":
            for expression in _items(node.projectList()):
                inner = expression
                if inner.getClass().getSimpleName() == "Alias":
                    inner = inner.child()
                if inner.getClass().getSimpleName() == "Cast" and _widening(inner):
                    inner = inner.child()
                if inner.getClass().getSimpleName() != "AttributeReference":
                    return f"column '{expression.name()}' is computed, not read from the files"
                if inner.name() != expression.name() and expression.name() in names:
                    return f"column '{expression.name()}' is renamed from '{inner.name()}'"
        children = _items(node.children())
        if len(children) != 1:
            return f"the DataFrame's plan joins {len(children)} inputs"
        node = children[0]


_NUMBERS = {"tinyint", "smallint", "int", "bigint", "float", "double"}


def _widening(cast) -> bool:
    """Whether a cast of a column is one the loader makes per batch anyway: numbers (or
    arrays of numbers) to float or double, as every feature is converted to ``dtype``.
    Not to integers (Spark's cast truncates, a class index must be whole)."""
    source, target = (t.simpleString() for t in (cast.child().dataType(), cast.dataType()))
    if source.startswith("array<") and target.startswith("array<"):
        source, target = source[6:-1], target[6:-1]
    return source in _NUMBERS and target in ("float", "double")


def _file_path(store: Store, uri: str) -> str | None:
    """``uri`` (as Spark lists it) as a path of the store's filesystem; None where it is on
    another filesystem."""
    url = spark_url(uri, "data_copy")
    protocol, path = fsspec.core.split_protocol(url)
    protocol = HADOOP_PROTOCOLS.get(protocol or "file", protocol or "file")
    if protocol in ("file", "local"):
        return path if store.protocol == "file" else None
    if protocol != store.protocol:
        return None
    return store.fs._strip_protocol(url)


def plain_scan(df: DataFrame, store: Store, names: list[str]) -> ParquetScan | str:
    """The Parquet files ``df`` reads when it is a plain scan of them whose columns
    ``names`` are the files' own; otherwise the reason it is not, in a few words."""
    if is_connect(df.sparkSession):
        return "on Spark Connect the plan's files are not visible to the driver"
    leaf = _leaf(df._jdf.queryExecution().analyzed(), names)
    if isinstance(leaf, str):
        return leaf
    relation = leaf.relation()
    if relation.getClass().getSimpleName() != "HadoopFsRelation":
        return f"it reads a {relation.getClass().getSimpleName()}, not files"
    file_format = relation.fileFormat().getClass().getSimpleName()
    if file_format != "ParquetFileFormat":
        return f"its files are read as {file_format}, not plain Parquet"
    partitions = set(relation.partitionSchema().fieldNames())
    if used := sorted(partitions & set(names)):
        return f"column '{used[0]}' is a partition column, not in the files"
    statuses = FILE_STATUS.findall(relation.location().allFiles().mkString("\n"))
    if not statuses:
        return "the table has no files"
    files = []
    for uri, size, modified in statuses:
        path = _file_path(store, uri)
        if path is None:
            return f"its files ({uri}) are not on the store's filesystem ({store.url})"
        files.append((path, int(size), int(modified)))
    root = posixpath.commonpath([posixpath.dirname(p) for p, _, _ in files])
    relative = sorted((posixpath.relpath(p, root), s, m) for p, s, m in files)
    return ParquetScan(root, tuple(relative))


def _footer(store: Store, root: str, path: str) -> pq.FileMetaData:
    with store.fs.open(posixpath.join(root, path), "rb") as f:
        return pq.ParquetFile(f).metadata


def _columns_readable(
    schema: pa.Schema, specs: list[tuple[str, ColumnSpec]], dtype: str, where: str
) -> str | None:
    """Why a column cannot be read in place (its Parquet type is not what the DataFrame's
    gives it), or None."""
    for role, spec in specs:
        try:
            found = parquet_column_spec(schema, spec.name, role, dtype, where)
        except (TypeError, ValueError):
            return f"column '{spec.name}' has a Parquet type the loader does not read"
        if found.kind != spec.kind:
            return f"column '{spec.name}' is {found.kind} in the files, {spec.kind} here"
    return None


def _needs_a_pass(specs: list[tuple[str, ColumnSpec]], schema: pa.Schema) -> bool:
    """Whether the checks need the rows (floats, arrays, class indices as floats), not only
    the footers' statistics."""
    for _, spec in specs:
        t = schema.field(spec.name).type
        if spec.kind != "scalar" and not spec.variable:
            return True
        if spec.kind == "scalar" and not (pa.types.is_integer(t) or pa.types.is_boolean(t)):
            return True
    return False


def in_place_dataset(df: DataFrame, scan: ParquetScan, store: Store, *args, **kwargs):
    """``checked_in_place`` of the table, which fits of this driver that read it at once
    (the trials of a tuning study) check one after the other: the first checks it, the
    others find its ``tables/<key>.json`` (``cache_key.one_writer``)."""
    with one_writer(store.url, scan.root):
        return checked_in_place(df, scan, store, *args, **kwargs)


def checked_in_place(
    df: DataFrame,
    scan: ParquetScan,
    store: Store,
    features: list[ColumnSpec],
    labels: list[ColumnSpec],
    validation,
    seed: int,
    sample_weight: ColumnSpec | None = None,
    input_shapes: list[list[int]] | None = None,
    dtype: str = "float32",
    check=None,
) -> DatasetInfo | str:
    """The dataset of ``scan``'s files, read in place (see the module), checked; the one
    ``tables/<key>.json`` holds when a fit of the same data made it before. A string where
    a column's Parquet type cannot be read in place: why (the fit then materializes)."""
    source = source_fingerprint(df)
    columns = checked_columns(features, labels, sample_weight)
    options = {"in_place": True}
    key = cache_key(source, features + labels, validation, seed, options, sample_weight)
    path = store.table(key)
    if store.exists(path):
        data = DatasetInfo.from_json(scan.root, store.read_json(path), reused=True)
        check_dataset(data, input_shapes, check)
        return data
    with ThreadPoolExecutor(8) as pool:
        footers = list(
            pool.map(functools.partial(_footer, store, scan.root), [f[0] for f in scan.files])
        )
    schema = footers[0].schema.to_arrow_schema()
    if reason := _columns_readable(schema, columns, dtype, scan.root):
        return reason
    names = [spec.name for _, spec in columns]
    layout, group_bytes = table_layout([f[0] for f in scan.files], footers, names)
    split = _row_split(validation, seed)
    from_floats = frozenset(
        c.name
        for c in labels
        if c.kind == "scalar" and c.integral and not pa.types.is_integer(schema.field(c.name).type)
    )
    checked = counted_columns(columns, from_floats)
    metrics, validation_rows, verify = None, {}, ()
    table_bytes = sum(map(sum, group_bytes))
    needs_a_pass = _needs_a_pass(columns, schema)
    if split.column is None and (table_bytes > CHECK_PASS_BYTES or not needs_a_pass):
        arrays = [c.name for c in checked if c.array]
        first = _first_lengths(store, scan, footers, arrays)
        metrics = _footer_counts(footers, columns, checked, first)
        if metrics is not None and needs_a_pass:
            verify = tuple(
                (role, spec.name, c.finite, metrics.get(f"c{i}_min_length"))
                for i, ((role, spec), c) in enumerate(zip(columns, checked))
            )
    if metrics is None:
        metrics, validation_rows = _count(df, store, scan.root, layout, checked, split.column)
    row_lengths, ragged = check_observed(metrics, columns)
    integers = {c.name for c in features + labels if sequence_element_integral(df.schema, c.name)}
    features, labels = (
        [as_sequence(c, c.name in integers) if c.name in ragged else c for c in specs]
        for specs in (features, labels)
    )
    in_place = InPlace(
        layout=tuple((p, tuple(g)) for p, g in layout),
        group_bytes=group_bytes,
        sizes=tuple((p, s) for p, s, _ in scan.files),
        fraction=split.fraction,
        seed=split.seed,
        column=split.column,
        verify=verify,
    )
    data = DatasetInfo(
        path=scan.root,
        features=features,
        labels=labels,
        files=_split_files(layout, split, validation_rows),
        reused=False,
        source={**source, "files": len(scan.files), "key": key},
        sample_weight=sample_weight,
        row_lengths=row_lengths,
        label_ranges=counted_label_ranges(metrics, columns),
        in_place=in_place,
        row_names=row_names_column(arrow_strings(schema), features + labels),
    )
    check_not_empty(data, validation)
    check_dataset(data, input_shapes, check)
    store.write_json(path, data.to_json())
    return data


def table_layout(
    paths: list[str], footers: list[pq.FileMetaData], names: list[str]
) -> tuple[list[tuple[str, list[int]]], tuple[tuple[int, ...], ...]]:
    """Each file's rows per row group, and each row group's uncompressed bytes of the
    columns ``names`` (what the loader sizes its pieces by, ``even_pieces``)."""
    layout, group_bytes = [], []
    for path, meta in zip(paths, footers):
        groups, sizes = [], []
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            groups.append(group.num_rows)
            sizes.append(
                sum(
                    group.column(c).total_uncompressed_size
                    for c in range(group.num_columns)
                    if group.column(c).path_in_schema.split(".")[0] in names
                )
            )
        layout.append((path, groups))
        group_bytes.append(tuple(sizes))
    return layout, tuple(group_bytes)


def _row_split(validation, seed: int) -> RowSplit:
    if validation is None:
        return RowSplit()
    if isinstance(validation, str):
        return RowSplit(column=validation)
    return RowSplit(fraction=float(validation), seed=seed)


def _split_files(layout, split: RowSplit, validation_rows: dict) -> dict:
    """Each split's rows per row group, in the files' order (``DatasetInfo.files``)."""
    files = {"train": [], "validation": []}
    first = 0
    for path, groups in layout:
        train, held = [], []
        for index, rows in enumerate(groups):
            if split.column is not None:
                held_rows = validation_rows[path, index]
            else:
                held_rows = int(split.validation(first, rows).sum())
            held.append(held_rows)
            train.append(rows - held_rows)
            first += rows
        files["train"].append((path, train))
        files["validation"].append((path, held))
    if split.fraction is None and split.column is None:
        files["validation"] = []
    return files


def _count(df, store, root, layout, checked, column) -> tuple[dict, dict]:
    """The value checks' counts over every row group, and each one's validation rows:
    one Spark job that reads the row groups with pyarrow and writes nothing."""
    spark = df.sparkSession
    pieces = [(p, g) for p, groups in layout for g in range(len(groups))]
    slots = max(1, spark.sparkContext.defaultParallelism)
    target = TableCounts(store, root, tuple(checked), column)
    rows = (
        spark.createDataFrame(pieces, "path string, row_group int")
        .repartition(min(len(pieces), slots * 4))
        .mapInArrow(functools.partial(count_row_groups, target=target), COUNTED_SCHEMA)
        .collect()
    )
    metrics: dict = {}
    for row in rows:
        metrics = merge_stats(metrics, json.loads(row.stats))
    return metrics, {(r.path, r.row_group): r.validation_rows for r in rows}


def _first_lengths(store: Store, scan: ParquetScan, footers, names: list[str]) -> dict[str, int]:
    """The length of the table's first row of each list column of ``names`` (a page of
    each read, not a row group): what every row of a fixed-length column holds."""
    for (path, _, _), meta in zip(scan.files, footers):
        if meta.num_rows and names:
            with store.fs.open(posixpath.join(scan.root, path), "rb") as f:
                batch = next(pq.ParquetFile(f).iter_batches(batch_size=1, columns=names))
            return {
                name: len(batch.column(name)[0])
                for name in names
                if pa.types.is_list(batch.schema.field(name).type)
                and batch.column(name)[0].is_valid
            }
    return {}


def _footer_counts(footers, columns, checked, first_lengths: dict[str, int]) -> dict | None:
    """The counts the checks need, from the files' statistics alone; None where those do
    not settle them (a column without statistics, nulls or empty arrays in an array column,
    arrays whose values do not add up to the first row's length per row, an infinite
    value, ML vectors): the pass counts them then. NaN has no statistic, nor has each
    row's length: the ranks check those as they read (``InPlace.verify``)."""
    metrics: dict = {}
    for meta in footers:
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            leaves: dict[str, list] = {}
            for c in range(group.num_columns):
                chunk = group.column(c)
                leaves.setdefault(chunk.path_in_schema.split(".")[0], []).append(chunk)
            counts = {}
            for i, ((_, spec), check) in enumerate(zip(columns, checked)):
                found = leaves.get(spec.name, [])
                stats = found[0].statistics if len(found) == 1 else None
                if stats is None or not stats.has_null_count:
                    return None
                if check.array:
                    length = first_lengths.get(spec.name)
                    if stats.null_count or length is None:
                        return None  # null rows, null elements or empty arrays: counted
                    if found[0].num_values != group.num_rows * length:
                        return None  # rows of other lengths: counted
                    counts[f"c{i}_min_length"] = counts[f"c{i}_max_length"] = length
                else:
                    counts[f"c{i}_null_rows"] = stats.null_count
                if check.finite and not _finite_bounds(stats, found[0].physical_type):
                    return None
                if check.classes and stats.has_min_max:
                    counts[f"c{i}_min_value"], counts[f"c{i}_max_value"] = (
                        int(stats.min),
                        int(stats.max),
                    )
            metrics = merge_stats(metrics, counts)
    return metrics


def _finite_bounds(stats, physical_type: str) -> bool:
    """Whether a column chunk's statistics show no infinite value (NaN they never show)."""
    if physical_type not in ("FLOAT", "DOUBLE"):
        return True
    if not stats.has_min_max:
        return stats.null_count == stats.num_values  # only nulls: nothing to bound
    return math.isfinite(stats.min) and math.isfinite(stats.max)
