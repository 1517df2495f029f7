"""Executor: the value checks of a table read in place, counted in one pass that writes
nothing (``driver.in_place``'s job): each task reads its row groups with pyarrow, as a rank
will, and counts what materialization's write counts of the rows it writes
(``column_stats``: nulls, NaN and infinite values, array lengths, class-index ranges), and,
for a validation column, each row group's validation rows."""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ...shared.column_stats import CheckedColumn, column_stats
from ...store import Store

COUNTED_SCHEMA = "path string, row_group int, stats string, validation_rows long"
_COUNTED = pa.schema(
    [
        ("path", pa.string()),
        ("row_group", pa.int32()),
        ("stats", pa.string()),
        ("validation_rows", pa.int64()),
    ]
)


@dataclass(frozen=True)
class TableCounts:
    """What the tasks count (pickled to them): the table's folder in ``store``, the columns
    checked, the validation column (None: a fraction or no split)."""

    store: Store
    root: str
    checked: tuple[CheckedColumn, ...]
    column: str | None = None


def count_row_groups(
    batches: Iterator[pa.RecordBatch], target: TableCounts
) -> Iterator[pa.RecordBatch]:
    """The ``mapInArrow`` function: for each (path, row group) row, the counts of the value
    checks over the row group's rows and its validation rows."""
    names = [c.name for c in target.checked]
    if target.column is not None and target.column not in names:
        names.append(target.column)
    out = []
    for batch in batches:
        for path, group in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()):
            with target.store.fs.open(posixpath.join(target.root, path), "rb") as f:
                table = pq.ParquetFile(f).read_row_group(group, columns=names)
            validation = 0
            if target.column is not None:
                marks = pc.fill_null(pc.cast(table.column(target.column), pa.bool_()), False)
                validation = pc.sum(marks).as_py() or 0
            stats = column_stats(table, list(target.checked))
            out.append(
                {
                    "path": path,
                    "row_group": group,
                    "stats": json.dumps(stats),
                    "validation_rows": validation,
                }
            )
    yield pa.RecordBatch.from_pylist(out, schema=_COUNTED)
