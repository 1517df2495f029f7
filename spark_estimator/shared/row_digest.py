"""Both sides: an order-independent digest of a materialized dataset's rows, which tells
two copies of the same rows apart from copies of different ones across Spark applications.

Each row's 64-bit hash is Spark's ``xxhash64`` of the row's values as written (the selected
columns converted, in order; and the split where a validation column decides it), a column
the write adds (``HASH_COL``) and the writer drops. The writer sums the hashes of the rows
it writes modulo 2**64 and counts them (``row_hashes``), per file, beside the value checks'
counts; the driver merges those by summing (``column_stats.merge_stats``), and
``content_digest`` gives the dataset's digest: the row count and the sum. Equal multisets of
rows give equal digests whatever their order or partitioning; a changed value changes its
row's hash and so the sum (two different datasets collide with probability about 2**-64).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

HASH_COL = "__spark_estimator_row_hash"  # the column of each row's hash (never written)
_SUM, _ROWS = "rows_hash_sum", "rows_hashed"  # the keys of the counts
_MOD = 2**64


def row_hashes(table: pa.Table) -> dict[str, int]:
    """The sum (modulo 2**64) of ``table``'s row hashes (its ``HASH_COL``) and its rows."""
    hashes = table.column(HASH_COL).to_numpy().astype(np.int64, copy=False)
    total = int(hashes.view(np.uint64).sum(dtype=np.uint64))  # wraps: modulo 2**64
    return {_SUM: total, _ROWS: len(hashes)}


def content_digest(counts: dict[str, int]) -> dict:
    """The digest of the rows whose ``row_hashes`` were merged into ``counts``: their
    number and the sum of their hashes as 16 hex digits."""
    return {"rows": int(counts.get(_ROWS, 0)), "digest": f"{counts.get(_SUM, 0) % _MOD:016x}"}
