import numpy as np
import pyarrow as pa

from spark_estimator.shared.column_stats import merge_stats
from spark_estimator.shared.row_digest import HASH_COL, content_digest, row_hashes


def table(hashes) -> pa.Table:
    return pa.table({"x": pa.array([0.0] * len(hashes)), HASH_COL: pa.array(hashes, pa.int64())})


def digest(*tables) -> dict:
    counts: dict[str, int] = {}
    for t in tables:
        counts = merge_stats(counts, row_hashes(t))
    return content_digest(counts)


def test_the_digest_of_rows_is_the_same_in_any_order_and_any_files():
    hashes = np.random.default_rng(0).integers(-(2**63), 2**63 - 1, size=100).tolist()
    whole = digest(table(hashes))
    assert whole["rows"] == 100 and len(whole["digest"]) == 16
    assert digest(table(hashes[::-1])) == whole
    assert digest(table(hashes[60:]), table(hashes[:10]), table(hashes[10:60])) == whole
    assert digest(table([])) == {"rows": 0, "digest": "0" * 16}


def test_the_sum_wraps_modulo_2_to_the_64():
    top = 2**63 - 1
    assert digest(table([top, top, 2])) == {"rows": 3, "digest": "0" * 16}  # 2**64 wraps to 0
    assert digest(table([-1])) == {"rows": 1, "digest": "f" * 16}


def test_any_changed_or_added_row_changes_the_digest():
    base = digest(table([1, 2, 3]))
    assert digest(table([1, 2, 4]))["digest"] != base["digest"]
    assert digest(table([1, 2, 3, 0])) != base  # a row hashing to 0 still counts
