"""Driver: the checks of a dataset's values, counted by the materialization's own write.

``counted_columns`` tells the executors' writer what to count in the batches it writes
(``column_stats``), so the data is not read twice: per column its null rows; per
array column its null elements and min/max length; per feature and float label its NaN and
infinite values; per scalar label of class indices its min and max (the probe tries the
loss on them, ``check_loss``), and where the DataFrame holds them as floats
(StringIndexer's labels), the values that are not whole numbers. ``check_observed`` (shared
with the ranks, in ``column_stats``) turns the merged counts into the error naming the
column, and ``check_row_lengths`` checks
``input_shapes`` against the row lengths (also for a dataset reused from the store, whose
``_meta.json`` records them; scalar columns are checked earlier, from the schema, by
``validate.check_input_shapes``).
"""

from __future__ import annotations

from collections.abc import Callable

from ..shared.column_stats import CheckedColumn
from ..shared.shapes import batch_shape
from ..shared.spec import ColumnSpec, DatasetInfo


def checked_columns(
    features: list[ColumnSpec], labels: list[ColumnSpec], sample_weight: ColumnSpec | None
) -> list[tuple[str, ColumnSpec]]:
    roles = [("feature", c) for c in features] + [("label", c) for c in labels]
    return roles + ([("sample_weight", sample_weight)] if sample_weight is not None else [])


def _finite_checked(role: str, spec: ColumnSpec) -> bool:
    """NaN and +-inf are rejected in features and float labels."""
    return role == "feature" or (role == "label" and not spec.integral)


def counted_columns(
    columns: list[tuple[str, ColumnSpec]], from_floats: frozenset[str] = frozenset()
) -> tuple[CheckedColumn, ...]:
    """What the writer counts for each checked column, in order (see the module);
    ``from_floats``: the class-index labels the DataFrame holds as floats."""
    return tuple(
        CheckedColumn(
            spec.name,
            spec.kind in ("array", "vector"),
            _finite_checked(role, spec),
            classes=_class_indices(role, spec),
            whole=_class_indices(role, spec) and spec.name in from_floats,
        )
        for role, spec in columns
    )


def _class_indices(role: str, spec: ColumnSpec) -> bool:
    return role == "label" and spec.kind == "scalar" and spec.integral


def label_ranges(metrics: dict, columns: list[tuple[str, ColumnSpec]]) -> dict[str, list[int]]:
    """The [min, max] of each class-index label column, as the write counted them."""
    ranges = {}
    for i, (_, spec) in enumerate(columns):
        if f"c{i}_min_value" in metrics:
            ranges[spec.name] = [metrics[f"c{i}_min_value"], metrics[f"c{i}_max_value"]]
    return ranges


def check_row_lengths(data: DatasetInfo, input_shapes: list[list[int]] | None) -> None:
    """Each shape must hold as many values per row as its feature column's rows (1 for
    scalars; array lengths as recorded in ``_meta.json``)."""
    for spec, shape in zip(data.features, input_shapes or []):
        if spec.kind == "sequence" and shape is not None:
            raise ValueError(
                f"input_shapes: column '{spec.name}' has arrays of varying length, padded per "
                "batch to its longest; give no shape for it"
            )
        length = data.row_length(spec)
        if length is not None:
            check_shape_fits(shape, spec.name, length)


def check_dataset(
    data: DatasetInfo,
    input_shapes: list[list[int]] | None,
    check: Callable[[DatasetInfo], None] | None,
) -> None:
    """The checks of a dataset once it is described, found or made (materialized or read
    in place): ``input_shapes`` against its row lengths, then the fit's own ``check`` (the
    probe batch's loss)."""
    check_row_lengths(data, input_shapes)
    if check is not None:
        check(data)


def check_shape_fits(shape: list[int], column: str, length: int) -> None:
    """An ``input_shapes`` entry must hold ``length`` values per row."""
    batch_shape(shape, length, column)
