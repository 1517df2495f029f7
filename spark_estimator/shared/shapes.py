"""The ``input_shapes`` param's entries, read the same on the driver and the executors.

An entry is either a batch's shape, ``[-1, d1, ...]`` (-1 first: the rows), or one row's
shape, ``[d1, ...]``, as Horovod's users write it (``[[1, 28, 28]]``). A row's shape is
taken as such when its size is the column's row length; a shape that cannot hold a row is
refused naming both sizes. No torch here: the driver checks shapes before any import of it.
"""

from __future__ import annotations

import math


def row_length(shape: list[int]) -> int:
    """How many values one row holds under ``shape`` (either form)."""
    return math.prod(shape[1:] if shape[0] == -1 else shape)


def batch_shape(shape: list[int], length: int, column: str) -> list[int]:
    """``shape`` as a batch's shape (``[-1, d1, ...]``) for a column with rows of ``length``
    values; a ValueError naming ``input_shapes``, the column and both sizes when it cannot
    hold a row."""
    per_row = row_length(shape)
    if per_row != length:
        raise ValueError(
            f"input_shapes: shape {shape} has {per_row} elements per row, but column "
            f"'{column}' has rows of length {length}; give one row's shape (e.g. [1, 8, 8] "
            "for rows of 64) or the batch's, with -1 first ([-1, 1, 8, 8])"
        )
    return shape if shape[0] == -1 else [-1, *shape]
