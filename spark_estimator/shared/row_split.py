"""Which split each row of Parquet read in place belongs to, without writing the split.

A fit that trains on a table's own files (``driver.in_place``) cannot partition them into
train and validation folders, so the split is a function of each row: with ``validation``
a fraction, a row is a validation row when a uniform number drawn from (``random_seed``,
the row's index in the table) is below it; with a column, when the column says so
(boolean or 0/1, null counting as training, as a materialized split does). A row's index
is its place in the files' order (path order, then row groups, then rows): the same on the
driver, which counts each row group's rows of either split, and on the executors, which
keep a piece's rows of their split as they read it. The draw (a splitmix64 hash of the
seed and the index) needs no state, so every split is deterministic and complementary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX_1, _MIX_2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def uniform(seed: int, index: np.ndarray) -> np.ndarray:
    """A number in [0, 1) for each row ``index`` (int64), from ``seed``: splitmix64."""
    with np.errstate(over="ignore"):
        z = index.astype(np.uint64) * _GOLDEN + np.uint64(seed % 2**64) * _MIX_2
        z = (z ^ (z >> np.uint64(30))) * _MIX_1
        z = (z ^ (z >> np.uint64(27))) * _MIX_2
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


@dataclass(frozen=True)
class RowSplit:
    """How a table read in place is split: ``fraction`` with ``seed``, or ``column``; neither
    (all rows training) when there is no ``validation``."""

    fraction: float | None = None
    seed: int = 0
    column: str | None = None

    def validation(self, first: int, rows: int, marks: np.ndarray | None = None) -> np.ndarray:
        """Whether each of ``rows`` rows from table index ``first`` is a validation row;
        ``marks``: the validation column's values for them (a column split)."""
        if self.column is not None:
            if marks is None:
                raise ValueError("a column split needs the column's values")
            return np.asarray(marks, dtype=bool)
        if self.fraction is None:
            return np.zeros(rows, dtype=bool)
        return uniform(self.seed, np.arange(first, first + rows, dtype=np.int64)) < self.fraction

    def rows(self, split: str, first: int, count: int, marks: np.ndarray | None = None):
        """The positions (within the ``count`` rows from table index ``first``) of the rows
        of ``split``."""
        validation = self.validation(first, count, marks)
        return np.flatnonzero(validation if split == "validation" else ~validation)
