import math

import pyarrow as pa

from spark_estimator.shared.column_stats import (
    CheckedColumn,
    as_written,
    column_stats,
    merge_stats,
)

COLUMNS = [
    CheckedColumn("x", array=True, finite=True),
    CheckedColumn("y", array=False, finite=True),
    CheckedColumn("k", array=False, finite=False),  # a class label: only nulls counted
]


def table(x, y, k) -> pa.Table:
    return pa.table(
        {
            "x": pa.array(x, pa.list_(pa.float32())),
            "y": pa.array(y, pa.float32()),
            "k": pa.array(k, pa.int64()),
        }
    )


def test_counts_nulls_non_finite_values_and_array_lengths():
    t = table(
        [[1.0, None, 3.0], None, [math.nan, 2.0], [math.inf, -math.inf, 0.0]],
        [0.5, None, math.nan, -math.inf],
        [1, None, None, 0],
    )
    assert column_stats(t, COLUMNS) == {
        "c0_null_rows": 1,
        "c0_null_elements": 1,
        "c0_min_length": 2,
        "c0_max_length": 3,
        "c0_non_finite": 3,
        "c1_null_rows": 1,
        "c1_non_finite": 2,
        "c2_null_rows": 2,
    }


def test_clean_rows_count_zero_and_all_null_arrays_have_no_length():
    clean = column_stats(table([[1.0, 2.0]], [1.0], [3]), COLUMNS)
    assert clean["c0_null_elements"] == clean["c0_non_finite"] == clean["c1_non_finite"] == 0
    assert (clean["c0_min_length"], clean["c0_max_length"]) == (2, 2)
    assert "c0_min_length" not in column_stats(table([None], [1.0], [3]), COLUMNS)


def test_merging_sums_counts_and_widens_the_length_range():
    a = {"c0_null_rows": 1, "c0_min_length": 2, "c0_max_length": 2}
    b = {"c0_null_rows": 2, "c0_min_length": 3, "c0_max_length": 3, "c1_non_finite": 4}
    assert merge_stats(a, b) == {
        "c0_null_rows": 3,
        "c0_min_length": 2,
        "c0_max_length": 3,
        "c1_non_finite": 4,
    }
    assert merge_stats({}, a) == a


def test_class_indices_count_their_range_and_floats_that_are_not_whole():
    labels = pa.table({"k": pa.array([2, 0, None, 5], pa.int64())})
    classes = [CheckedColumn("k", array=False, finite=False, classes=True)]
    assert column_stats(labels, classes) == {
        "c0_null_rows": 1,
        "c0_min_value": 0,
        "c0_max_value": 5,
    }
    floats = pa.table({"k": pa.array([2.0, 0.5, None, math.nan, 1.0], pa.float64())})
    as_floats = [CheckedColumn("k", array=False, finite=False, classes=True, whole=True)]
    stats = column_stats(floats, as_floats)
    assert stats["c0_not_whole"] == 2 and stats["c0_null_rows"] == 1
    whole = pa.table({"k": pa.array([2.0, 0.0, 1.0], pa.float64())})
    assert column_stats(whole, as_floats)["c0_not_whole"] == 0
    written = as_written(whole, as_floats)
    assert written.column("k").type == pa.int64()
    assert written.column("k").to_pylist() == [2, 0, 1]
    merged = merge_stats(
        {"c0_min_value": 1, "c0_max_value": 3}, {"c0_min_value": 0, "c0_max_value": 2}
    )
    assert merged == {"c0_min_value": 0, "c0_max_value": 3}
