"""input_shapes entries: a batch's shape with -1 first, or one row's shape (Horovod's form)."""

import pytest

from spark_estimator.shared.shapes import batch_shape, row_length


def test_a_row_shape_whose_size_is_the_rows_length_gets_the_batch_dimension():
    assert batch_shape([1, 28, 28], 784, "img") == [-1, 1, 28, 28]
    assert batch_shape([2], 2, "x") == [-1, 2]
    assert batch_shape([-1, 1, 28, 28], 784, "img") == [-1, 1, 28, 28]
    assert batch_shape([-1], 1, "s") == [-1]


@pytest.mark.parametrize(
    "shape, message",
    [
        ([3], r"shape \[3\] has 3 elements per row, but column 'x' has rows of length 2"),
        ([-1, 3], r"shape \[-1, 3\] has 3 elements per row, but column 'x' has rows of length 2"),
        ([4, 2], r"shape \[4, 2\] has 8 elements per row"),  # not read as a batch of 4
    ],
)
def test_a_shape_that_cannot_hold_a_row_is_refused_naming_both_sizes(shape, message):
    with pytest.raises(ValueError, match=f"input_shapes: {message}"):
        batch_shape(shape, 2, "x")


def test_row_length_of_either_form():
    assert row_length([-1, 1, 8, 8]) == row_length([1, 8, 8]) == 64
    assert row_length([-1]) == 1
