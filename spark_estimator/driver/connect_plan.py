"""Driver: what identifies the rows of a Spark Connect DataFrame (for ``cache_key``).

A Connect DataFrame holds its plan as the protobuf message the client sends to the server;
the server's analyzed plan is reachable only as text. The fingerprint is built from

- a digest of the client's plan, normalized so that the same query built again, in
  another session or process, gives the same digest: plan ids (a per-process counter) are
  renumbered in order of appearance, and call-site origins (file and line of the user's
  code) are dropped. Local rows (``createDataFrame``) are inside this plan, or their
  content hash is for large ones; read paths and options too (only the digest is kept, as
  options may hold credentials);
- the server's analyzed plan text, expression ids normalized (how names, views and types
  resolved), and the schema;
- every input file with its size and modification time, asked from the server by one
  small Spark job (a ``binaryFile`` listing that reads no content).

Such a key is valid across sessions only when every source of rows is described by the
plan itself: local rows, ``range``, and file reads by path. Any other source (a table or
view by name, SQL text, a server-side cached DataFrame, a Python data source) may hold
other rows later, so its key also holds the server's semantic hash and the session id:
reused within that Connect session only.
"""

from __future__ import annotations

import hashlib
import re
from urllib.parse import unquote

from google.protobuf.message import Message
from pyspark.sql import DataFrame

# sources whose rows the plan message itself describes
_CONTENT_SOURCES = {"local_relation", "cached_local_relation", "chunked_cached_local_relation"}
_STABLE_SOURCES = _CONTENT_SOURCES | {"range"}
_DROPPED = {"origin", "source_info"}  # debugging information: where the user's code ran
_EXPR_ID = re.compile(r"#\d+")
_GLOB = re.compile(r"([\\{}\[\]*?])")


def _messages(field, value) -> list:
    """The messages a field of a message holds: one, a repeated list, or a map's values."""
    if field.message_type is None:
        return []
    if field.message_type.GetOptions().map_entry:
        entry_value = field.message_type.fields_by_name["value"]
        return list(value.values()) if entry_value.message_type is not None else []
    return [value] if isinstance(value, Message) else list(value)


def normalize(message) -> None:
    """Renumber plan ids by first appearance and drop origins, in place, recursively."""
    ids: dict[int, int] = {}

    def visit(msg) -> None:
        for field, value in msg.ListFields():
            if field.name in _DROPPED:
                msg.ClearField(field.name)
            elif field.name == "plan_id" and field.message_type is None:
                setattr(msg, field.name, ids.setdefault(value, len(ids)))
            else:
                for item in _messages(field, value):
                    visit(item)

    visit(message)


def sources(message) -> list[str]:
    """The row sources of a plan: each relation with no child relation, by its type
    (``read.files`` for a read by paths, ``read.named_table``, ...)."""
    found: list[str] = []

    def visit(msg) -> None:
        is_relation = msg.DESCRIPTOR.full_name == "spark.connect.Relation"
        kind = msg.WhichOneof("rel_type") if is_relation else None
        if kind is not None:
            body = getattr(msg, kind)
            if not _has_child_relation(body):
                found.append(_read_kind(body) if kind == "read" else kind)
        for field, value in msg.ListFields():
            for item in _messages(field, value):
                visit(item)

    visit(message)
    return found


def parquet_read_paths(message) -> list[str]:
    """The paths of every plain Parquet read by paths in a plan (``spark.read.parquet``,
    ``format("parquet").load``; Spark's default source when no format is given)."""
    found: list[str] = []

    def visit(msg) -> None:
        if msg.DESCRIPTOR.full_name == "spark.connect.Read.DataSource":
            if (msg.format or "parquet").lower() == "parquet":
                found.extend(msg.paths)
        for field, value in msg.ListFields():
            for item in _messages(field, value):
                visit(item)

    visit(message)
    return found


def _read_kind(read) -> str:
    """``read.files`` for a data source read by paths, else ``read.<type>``."""
    kind = read.WhichOneof("read_type")
    return "read.files" if kind == "data_source" and read.data_source.paths else f"read.{kind}"


def _has_child_relation(body) -> bool:
    return any(
        f.message_type is not None and f.message_type.full_name == "spark.connect.Relation"
        for f, _ in body.ListFields()
    )


def plan_digest(plan) -> str:
    """The sha256 of a normalized copy of ``plan`` (a ``spark.connect.Plan``)."""
    copy = type(plan)()
    copy.CopyFrom(plan)
    normalize(copy)
    return hashlib.sha256(copy.SerializeToString(deterministic=True)).hexdigest()


def analyzed_text(df: DataFrame) -> str:
    """The server's analyzed plan as text, expression ids normalized."""
    text = df._explain_string(extended=True)
    section = text.split("== Analyzed Logical Plan ==", 1)[-1]
    section = section.split("== Optimized Logical Plan ==", 1)[0]
    return _EXPR_ID.sub("#", section.strip())


def file_metadata(df: DataFrame) -> list[list] | None:
    """[path, size, modification time in ms] of every input file, asked from the server
    (one ``binaryFile`` job that lists and reads no content); None if any is missing."""
    names = sorted(df.inputFiles())
    if not names:
        return []
    paths = [_GLOB.sub(r"\\\1", unquote(name)) for name in names]  # URIs -> literal paths
    rows = (
        df.sparkSession.read.format("binaryFile")
        .load(paths)
        .selectExpr("path", "length", "unix_millis(modificationTime) AS mtime")
        .collect()
    )
    if len(rows) != len(names):
        return None
    return sorted([r.path, r.length, r.mtime] for r in rows)


def connect_fingerprint(df: DataFrame) -> dict:
    """What identifies the rows of the Connect DataFrame ``df`` (see the module's doc)."""
    plan = df._plan.to_proto(df.sparkSession.client)
    kinds = sources(plan)
    files = file_metadata(df)
    # a read by paths is trusted to list its files (Spark's file sources do)
    stable = files is not None and all(
        k in _STABLE_SOURCES or (k == "read.files" and files) for k in kinds
    )
    fingerprint = {
        "connect_plan": plan_digest(plan),
        "plan": analyzed_text(df),
        "schema": df.schema.json(),
        "sources": sorted(set(kinds)),
        "files": files or [],
    }
    if not stable:  # no identity beyond this session
        fingerprint["semantic_hash"] = df.semanticHash()
        fingerprint["session"] = df.sparkSession.session_id
    return fingerprint
