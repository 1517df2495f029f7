"""Driver: the key under which a DataFrame's materialized Parquet is kept in the store.

The key must be equal for the same data read the same way, also from a new Spark session,
and must change whenever the rows could differ. Spark's own ``semanticHash`` is not enough:
for file sources it changes from one session to the next, and Spark's canonical plan text
leaves out the files. So the key is built from

- the canonical analyzed plan (expression ids normalized) and the schema,
- for file sources (Parquet, CSV, ... tables): every input file with its size and
  modification time, so rewritten or added files give a new key, and a digest of the read
  options (never the options themselves: they may hold credentials),
- for in-memory leaves whose content is part of the plan (local data, ``range``): their
  semantic hash, which is computed from the rows and is stable across sessions,
- for any other leaf (an RDD, a JDBC relation, ...): an identity that holds only inside
  this Spark application, so such a key is found within a session and never across (a
  new driver's write of equal rows finds their first copy by the digest of its rows'
  content instead: ``materialize``),
- the selected columns, their dtypes, the validation split and the write options.

On Spark Connect the JVM's plan is not reachable from Python; ``connect_fingerprint`` builds
the fingerprint from the client's plan message, the server's analyzed plan text and the
input files instead, with the same rules (valid across sessions only where the plan
describes its rows).

Fits of one driver that need a dataset of the same key at once (the trials of a tuning
study, a CrossValidator's threads) make it one at a time (``one_writer``): the first
writes it, the others then find it in the store.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict

from pyspark.sql import DataFrame

from ..shared.spec import DATASET_FORMAT_VERSION, ColumnSpec
from .launch import is_connect

_CONTENT_LEAVES = {"LocalRelation", "Range", "OneRowRelation"}
_FILE_LEAVES = {"HiveTableRelation"}
_WRITERS: dict[tuple[str, str], threading.Lock] = {}  # (store url, key) -> its writer's lock
_WRITERS_LOCK = threading.Lock()


@contextmanager
def one_writer(store_url: str, key: str) -> Iterator[None]:
    """Hold the block while no other thread of this process holds it for the same dataset
    key of the same store: fits started at once find or write the dataset one after the
    other, so it is written once."""
    with _WRITERS_LOCK:
        lock = _WRITERS.setdefault((store_url, key), threading.Lock())
    with lock:
        yield


def _leaves(plan) -> list:
    iterator = plan.collectLeaves().iterator()
    leaves = []
    while iterator.hasNext():
        leaves.append(iterator.next())
    return leaves


def _is_file_leaf(leaf) -> bool:
    name = leaf.getClass().getSimpleName()
    if name == "LogicalRelation":
        return leaf.relation().getClass().getSimpleName() == "HadoopFsRelation"
    return name in _FILE_LEAVES


# one of Hadoop's FileStatus as its toString writes it (stable across Hadoop 3)
FILE_STATUS = re.compile(
    r"path=([^;]*); isDirectory=false; length=(\d+);.*?modification_time=(\d+)"
)


def _same_file(name: str) -> str:
    """A file's URI as Spark's listings and ``inputFiles`` both spell it (``file:/x`` and
    ``file:///x`` are one local file)."""
    return re.sub(r"^file:/+", "file:///", name)


def _listed(leaves: list) -> dict[str, tuple[int, int]]:
    """(size, modification time) of the files Spark listed for the file sources among
    ``leaves``, in one call each: their statuses as text, read here (a folder of 20,000
    images costs one JVM call, not 12 per file)."""
    found = {}
    for leaf in leaves:
        if leaf.getClass().getSimpleName() != "LogicalRelation":
            continue
        text = leaf.relation().location().allFiles().mkString("\n")
        for path, size, modified in FILE_STATUS.findall(text):
            found[_same_file(path)] = (int(size), int(modified))
    return found


def _file_metadata(df: DataFrame, leaves: list) -> list[list]:
    """[path, size, modification time] of every input file: from the statuses Spark listed
    (``_listed``), else through Hadoop's filesystems, one file at a time."""
    jvm, jsc = df.sparkSession._jvm, df.sparkSession._jsc
    conf = jsc.hadoopConfiguration()
    listed = _listed(leaves)
    out = []
    for name in sorted(df.inputFiles()):
        if (known := listed.get(_same_file(name))) is not None:
            out.append([name, *known])
            continue
        path = jvm.org.apache.hadoop.fs.Path(name)
        status = path.getFileSystem(conf).getFileStatus(path)
        out.append([name, status.getLen(), status.getModificationTime()])
    return out


def source_fingerprint(df: DataFrame) -> dict:
    """What identifies the rows of ``df``; persisted with the dataset it keys."""
    if is_connect(df.sparkSession):
        from .connect_plan import connect_fingerprint  # needs the Connect client's protobuf

        return connect_fingerprint(df)
    analyzed = df._jdf.queryExecution().analyzed()
    leaves, files = [], []
    for leaf in _leaves(analyzed):
        name = leaf.getClass().getSimpleName()
        if _is_file_leaf(leaf):
            files.append(leaf)
            options = leaf.relation().options().toString() if name == "LogicalRelation" else ""
            # read options may hold credentials: only their digest is kept (and persisted)
            digest = hashlib.sha256(options.encode()).hexdigest()
            leaves.append([name, leaf.canonicalized().toString(), digest])
        elif name in _CONTENT_LEAVES:
            leaves.append([name, leaf.semanticHash()])
        else:  # no stable identity: valid within this application only
            app = df.sparkSession.sparkContext.applicationId
            leaves.append([name, leaf.semanticHash(), app])
    return {
        "plan": analyzed.canonicalized().toString(),
        "schema": df.schema.json(),
        "leaves": leaves,
        "files": _file_metadata(df, files) if files else [],
    }


def cache_key(
    source: dict,
    columns: list[ColumnSpec],
    validation,
    seed: int,
    write_options: dict,
    sample_weight: ColumnSpec | None = None,
    row_names: str | None = None,
) -> str:
    spec = {
        "version": DATASET_FORMAT_VERSION,
        "source": source,
        "columns": [asdict(c) for c in columns],
        "validation": validation,
        "seed": seed if isinstance(validation, float) else None,
        "write": write_options,
    }
    if sample_weight is not None:  # absent otherwise, so datasets without one keep their key
        spec["sample_weight"] = asdict(sample_weight)
    if row_names is not None:  # likewise: the column naming rows, written beside them
        spec["row_names"] = row_names
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:24]
