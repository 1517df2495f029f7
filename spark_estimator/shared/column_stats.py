"""Executor: the counts behind the materialization's value checks, taken from the Arrow
batches the writer is writing anyway (vectorized ``pyarrow.compute``, no other pass).

Per column: its null rows; for array columns, null elements and the min and max length of
the non-null rows; for columns whose NaN and +-inf are rejected, how many values are not
finite; for scalar columns of class indices, their min and max value, and where they come
as floats (a double column of whole numbers, as StringIndexer makes), how many values are
not whole numbers (``as_written`` then writes them as int64). Keys are ``c<i>_<what>`` by
the column's position in the checked columns, as ``check_observed`` reads them (on the
driver; and on the ranks, for a table read in place whose values they check as they read
them, ``InPlace.verify``). Each written file's rows are counted
once: the driver merges the counts of the files the successful task attempts wrote.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from .spec import ColumnSpec, column_param


@dataclass(frozen=True)
class CheckedColumn:
    """One column to count: its name, whether it holds arrays, whether non-finite values
    are counted."""

    name: str
    array: bool
    finite: bool
    classes: bool = False  # class indices (a scalar column): their min and max are counted
    whole: bool = False  # class indices given as floats: values not whole are counted


def as_written(table: pa.Table, columns: list[CheckedColumn]) -> pa.Table:
    """``table`` with the class indices given as floats (``whole``) as int64, as every
    integral label is written; a value that is not whole is counted first, and the
    driver refuses the dataset."""
    for column in columns:
        if column.whole:
            i = table.column_names.index(column.name)
            values = pc.cast(table.column(i), pa.int64(), safe=False)
            table = table.set_column(i, column.name, values)
    return table


def column_stats(table: pa.Table, columns: list[CheckedColumn]) -> dict[str, int]:
    """The counts of ``table``'s rows (see the module)."""
    stats: dict[str, int] = {}
    for i, column in enumerate(columns):
        data = table.column(column.name)
        stats[f"c{i}_null_rows"] = data.null_count
        values = pc.list_flatten(data) if column.array else data
        if column.array:
            stats[f"c{i}_null_elements"] = values.null_count
            lengths = pc.min_max(pc.list_value_length(data)).as_py()
            if lengths["min"] is not None:
                stats[f"c{i}_min_length"], stats[f"c{i}_max_length"] = lengths.values()
        if column.finite and pa.types.is_floating(values.type):
            stats[f"c{i}_non_finite"] = pc.sum(pc.invert(pc.is_finite(values))).as_py() or 0
        if column.whole:
            whole = pc.and_(pc.is_finite(data), pc.equal(data, pc.floor(data)))
            stats[f"c{i}_not_whole"] = pc.sum(pc.invert(whole)).as_py() or 0
        if column.classes:
            bounds = pc.min_max(data).as_py()
            if bounds["min"] is not None and all(map(math.isfinite, bounds.values())):
                stats[f"c{i}_min_value"], stats[f"c{i}_max_value"] = map(int, bounds.values())
    return stats


def merge_stats(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    """The counts of two sets of rows together: sums, and the min and max of lengths."""
    merged = dict(a)
    for key, value in b.items():
        if key not in merged:
            merged[key] = value
        elif key.endswith(("_min_length", "_min_value")):
            merged[key] = min(merged[key], value)
        elif key.endswith(("_max_length", "_max_value")):
            merged[key] = max(merged[key], value)
        else:
            merged[key] += value
    return merged


def check_observed(
    metrics: dict, columns: list[tuple[str, ColumnSpec]]
) -> tuple[dict[str, int], set[str]]:
    """Raise for nulls, non-finite values or vectors of varying length found by the write's
    metrics (columns in order, nulls first); return each array column's row length, and the
    array columns whose lengths vary (read as sequences, padded per batch).

    Counts are of the files written, each counted once (by the task attempt that wrote it).
    """

    def get(name: str) -> int:
        return metrics.get(name) or 0

    for i, (role, spec) in enumerate(columns):
        rows, elements = get(f"c{i}_null_rows"), get(f"c{i}_null_elements")
        if rows + elements:
            param, name = column_param(role), spec.name
            detail = (
                f" ({rows} null rows, {elements} null elements inside arrays)" if elements else ""
            )
            inside = (
                f" (and where(~F.exists('{name}', lambda v: v.isNull())) for null elements)"
                if elements
                else ""
            )
            raise ValueError(
                f"{param}: column '{name}' has {rows + elements} null values{detail}; filter "
                f"them, e.g. df.na.drop(subset=['{name}']){inside}, or fill them before fit"
            )
    for i, (role, spec) in enumerate(columns):
        bad = get(f"c{i}_non_finite")
        if bad:
            kind = "feature" if role == "feature" else "label"
            raise ValueError(
                f"{column_param(role)}: column '{spec.name}' has {bad} NaN or infinite values; "
                f"they are rejected because a NaN or infinite {kind} makes the loss NaN "
                "without any error. Filter or replace them before fit"
            )
    for i, (_, spec) in enumerate(columns):
        bad = get(f"c{i}_not_whole")
        if bad:
            name = spec.name
            raise ValueError(
                f"label_cols: column '{name}' has {bad} values that are not whole numbers (or "
                "NaN or infinite); it is read as class indices 0, 1, ... (classification=True, "
                "or a class-index loss such as CrossEntropyLoss or NLLLoss), as int64. Give "
                f"whole numbers (e.g. StringIndexer's labels), or round them: "
                f"df.withColumn('{name}', F.round('{name}').cast('long'))"
            )
    lengths, ragged = {}, set()
    for i, (role, spec) in enumerate(columns):
        if spec.kind not in ("array", "vector"):
            continue
        lo, hi = metrics.get(f"c{i}_min_length"), metrics.get(f"c{i}_max_length")
        if lo is None:  # no rows
            continue
        if lo != hi and spec.kind == "vector":
            raise ValueError(
                f"{column_param(role)}: column '{spec.name}' has vectors of varying size "
                f"({lo} to {hi}); every row of a vector column must have the same size"
            )
        if lo != hi:
            ragged.add(spec.name)
        else:
            lengths[spec.name] = int(lo)
    return lengths, ragged
