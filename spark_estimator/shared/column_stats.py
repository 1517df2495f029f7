"""Executor: the counts behind the materialization's value checks, taken from the Arrow
batches the writer is writing anyway (vectorized ``pyarrow.compute``, no other pass).

Per column: its null rows; for array columns, null elements and the min and max length of
the non-null rows; for columns whose NaN and +-inf are rejected, how many values are not
finite; for scalar columns of class indices, their min and max value, and where they come
as floats (a double column of whole numbers, as StringIndexer makes), how many values are
not whole numbers (``as_written`` then writes them as int64). Keys are ``c<i>_<what>`` by
the column's position in the checked columns, as ``driver/data_checks.check_observed``
reads them. Each written file's rows are counted
once: the driver merges the counts of the files the successful task attempts wrote.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc


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
