"""Driver: a lake table's folder read as plain Parquet, refused before any job.

A Delta table's folder keeps the Parquet files of rows that later versions removed (until a
VACUUM) and, beside them, deletion-vector files of rows deleted inside a file; an Iceberg
table's ``data/`` folder likewise keeps older snapshots' files and its positional-delete
files. ``spark.read.parquet`` of such a folder reads every file, so its rows are already
wrong (removed and deleted rows included), whether the fit reads them in place or copies
them. ``check_not_table_folder`` refuses a plain Parquet read whose path, or a folder
above it, is a table's root (a ``_delta_log/`` folder, or ``metadata/*.metadata.json``),
naming the table, its current version and how to read it instead. Spark's own Delta and
Iceberg readers are not plain Parquet reads and pass.
"""

from __future__ import annotations

import json
import posixpath
import re

import fsspec
from pyspark.sql import DataFrame

from ..store import Store, spark_url
from .in_place import HADOOP_PROTOCOLS
from .launch import is_connect

_METADATA = re.compile(r"^(?:v?(\d+)[-.]).*\.metadata\.json$")


def _parquet_roots(df: DataFrame) -> list[str]:
    """The paths of ``df``'s plain Parquet reads (as they were given, or as Spark resolved
    them on a classic session)."""
    if is_connect(df.sparkSession):
        from .connect_plan import parquet_read_paths

        return parquet_read_paths(df._plan.to_proto(df.sparkSession.client))
    roots = []
    iterator = df._jdf.queryExecution().analyzed().collectLeaves().iterator()
    while iterator.hasNext():
        leaf = iterator.next()
        if leaf.getClass().getSimpleName() != "LogicalRelation":
            continue
        relation = leaf.relation()
        if relation.getClass().getSimpleName() != "HadoopFsRelation":
            continue
        if relation.fileFormat().getClass().getSimpleName() != "ParquetFileFormat":
            continue  # Delta's own reader (DeltaParquetFileFormat) and other formats
        paths = relation.location().rootPaths().iterator()
        while paths.hasNext():
            roots.append(paths.next().toString())
    return roots


def _ancestors(path: str) -> list[str]:
    """``path`` and every folder above it, nearest first."""
    out, path = [], path.rstrip("/") or "/"
    while True:
        out.append(path)
        parent = posixpath.dirname(path)
        if parent == path or not parent:
            return out
        path = parent


def _table_at(fs: fsspec.AbstractFileSystem, folder: str) -> str | None:
    """'Delta' or 'Iceberg' where ``folder`` is a table's root, else None."""
    if fs.isdir(posixpath.join(folder, "_delta_log")):
        return "Delta"
    metadata = posixpath.join(folder, "metadata")
    if fs.isdir(metadata) and any(
        _METADATA.match(posixpath.basename(p)) for p in fs.ls(metadata, detail=False)
    ):
        return "Iceberg"
    return None


def delta_state(uri: str, storage_options: dict | None = None) -> str:
    """'at version V (N live rows)' of the local Delta table at ``uri`` where the optional
    ``deltalake`` is installed, else 'at version V', its newest commit in the log."""
    fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    if fs.protocol in ("file", ("file", "local")):
        try:
            return _delta_live_rows(path)
        except ImportError:
            pass
    names = map(posixpath.basename, fs.ls(posixpath.join(path, "_delta_log"), detail=False))
    versions = [int(n[: -len(".json")]) for n in names if re.fullmatch(r"\d+\.json", n)]
    return f"at version {max(versions)}" if versions else "with no commits"


def _delta_live_rows(path: str) -> str:
    """'at version V (N live rows)', read by delta-rs: the rows of the version's files less
    those their deletion vectors delete."""
    import deltalake
    import pyarrow as pa
    import pyarrow.compute as pc

    table = deltalake.DeltaTable(path)
    actions = pa.table(table.get_add_actions(flatten=True))
    rows = pc.sum(actions.column("num_records")).as_py() if actions.num_rows else 0
    # each file with a deletion vector: its keep mask (False: a deleted row)
    masks = pa.table(table.deletion_vectors()).column("selection_vector")
    deleted = pc.sum(pc.invert(pc.list_flatten(masks))).as_py() if len(masks) else 0
    return f"at version {table.version()} ({(rows or 0) - (deleted or 0)} live rows)"


def iceberg_state(root: str, storage_options: dict | None = None) -> str:
    """'at snapshot S (N rows)' of the Iceberg table whose root is ``root``, from its newest
    metadata file (no reader needed): the snapshot summary's records less its positional
    and equality deletes."""
    fs, path = fsspec.core.url_to_fs(root, **(storage_options or {}))
    files = fs.ls(posixpath.join(path, "metadata"), detail=False)
    numbered = [
        (int(m.group(1)), f)
        for f in files
        if (m := _METADATA.match(posixpath.basename(f))) is not None
    ]
    with fs.open(max(numbered)[1], "r") as f:
        metadata = json.load(f)
    current = metadata.get("current-snapshot-id")
    if current is None or current == -1:
        return "with no snapshot"
    summary = next(
        (
            s.get("summary", {})
            for s in metadata.get("snapshots", [])
            if s["snapshot-id"] == current
        ),
        {},
    )
    rows = int(summary.get("total-records", 0))
    deletes = sum(
        int(summary.get(k, 0)) for k in ("total-position-deletes", "total-equality-deletes")
    )
    counted = f"{rows - deletes} rows" if "total-records" in summary else "rows not recorded"
    return f"at snapshot {current} ({counted})"


_HOW = {
    "Delta": (
        "Read it with Spark's Delta reader instead: "
        'spark.read.format("delta").load("{root}") (with its version: '
        '.option("versionAsOf", V)), which reads only the live rows'
    ),
    "Iceberg": (
        "Read it through its catalog instead (Spark's Iceberg reader: "
        'spark.table("catalog.db.table"), or spark.read.format("iceberg").load(...)), '
        "which reads only the current snapshot's live rows"
    ),
}


def check_not_table_folder(df: DataFrame, store: Store) -> None:
    """Refuse ``df`` where it reads a Delta or Iceberg table's files as plain Parquet (see
    the module's doc): a ValueError naming the table, its state and how to read it. Files
    on the store's object store are looked at with its credentials."""
    seen: set[str] = set()
    for path in _parquet_roots(df):
        uri = spark_url(re.sub(r"^file:///", "file:/", path))  # file:/x is the local /x
        protocol, rest = fsspec.core.split_protocol(uri)
        protocol = HADOOP_PROTOCOLS.get(protocol, protocol)
        uri = uri if protocol is None else f"{protocol}://{rest}"
        options = store.fsspec_target(store.root)[1] if protocol == store.protocol else None
        options = None if protocol in (None, "file") else options
        try:
            fs, local = fsspec.core.url_to_fs(uri, **(options or {}))
        except (ImportError, ValueError):  # a filesystem fsspec cannot open here: not checked
            continue
        for folder in _ancestors(local):
            if folder in seen:
                break
            seen.add(folder)
            kind = _table_at(fs, folder)
            if kind is None:
                continue
            root = fs.unstrip_protocol(folder) if protocol not in (None, "file") else folder
            state = (delta_state if kind == "Delta" else iceberg_state)(root, options)
            inside = "" if folder == local else f" ({path} is inside it)"
            raise ValueError(
                f"the DataFrame reads the Parquet files of a {kind} table's folder as plain "
                f"Parquet: {root}{inside}, a {kind} table {state}. Its folder also holds the "
                f"files of removed rows and older versions, so these rows are not the "
                f"table's. {_HOW[kind].format(root=root)}."
            )
