"""A binary or string column's rows held as references into Arrow memory."""

import pickle

import numpy as np
import pyarrow as pa
import pytest
import torch

from spark_estimator.shared.spec import ColumnSpec
from spark_estimator.worker.data.binary_rows import SPARSE, BinaryRows
from spark_estimator.worker.data.buckets import permute_rows
from spark_estimator.worker.data.columns import Layout
from spark_estimator.worker.data.convert import variable_rows
from spark_estimator.worker.data.loader import buffered_batches

BLOBS = [bytes([i]) * (i % 7) + b"row%d" % i for i in range(40)]


def rows_of(blobs, kind=None) -> BinaryRows:
    return BinaryRows.from_arrow(pa.array(blobs, kind or pa.binary()))


def test_rows_read_as_bytes_and_select_as_numpy_arrays_do():
    rows = rows_of(BLOBS)
    assert len(rows) == 40 and rows[3] == BLOBS[3] and rows.tolist() == BLOBS
    picked = rows[np.array([5, 0, 5])]
    assert picked.tolist() == [BLOBS[5], BLOBS[0], BLOBS[5]]
    assert rows[10:13].tolist() == BLOBS[10:13]
    assert np.asarray(rows).dtype == object and list(np.asarray(rows)) == BLOBS
    assert rows.nbytes == sum(map(len, BLOBS))


def test_a_sliced_arrow_array_and_strings_keep_their_rows():
    sliced = pa.array(BLOBS, pa.large_binary()).slice(7, 9)
    assert BinaryRows.from_arrow(sliced).tolist() == BLOBS[7:16]
    words = ["ä", "", "日本語", "plain"]
    text = rows_of(words, pa.string())
    assert text.text and text.tolist() == words and text[2] == "日本語"


def test_setting_rows_takes_the_other_rows_references_and_slices_are_views():
    left, right = rows_of(BLOBS[:20]), rows_of(BLOBS[20:])
    both = BinaryRows.concatenate([left, right])
    assert both.tolist() == BLOBS and len(both.parts) == 2
    view = both[5:10]
    view[...] = view[np.array([4, 3, 2, 1, 0])]  # in place, as bucketing does
    assert both.tolist()[5:10] == BLOBS[5:10][::-1]
    kept = both.copy()
    both[0:1] = right[0:1]
    assert both[0] == BLOBS[20] and kept[0] == BLOBS[0]


def test_pickled_rows_are_the_numpy_array_of_objects_decoding_has_always_had():
    for rows, want in (
        (rows_of(BLOBS)[::3], BLOBS[::3]),
        (rows_of(["a", "bé"], pa.string()), ["a", "bé"]),
    ):
        out = pickle.loads(pickle.dumps(rows, protocol=5))
        assert isinstance(out, np.ndarray) and out.dtype == object and list(out) == want


def test_rows_whose_parts_hold_much_more_are_compacted_into_their_own():
    rows = rows_of(BLOBS)
    few = rows[np.array([3, 30])]
    assert few.held_bytes() > SPARSE * few.nbytes
    compact = few.compacted()
    assert compact.tolist() == [BLOBS[3], BLOBS[30]] and compact.held_bytes() == few.nbytes
    assert rows.compacted() is rows  # all of its part: nothing to gain


def test_variable_rows_keeps_binary_and_string_columns_in_arrow_and_refuses_nulls():
    binary = variable_rows(
        ColumnSpec("b", "binary", "float32"), pa.chunked_array([BLOBS[:5], BLOBS[5:9]])
    )
    assert isinstance(binary, BinaryRows) and binary.tolist() == BLOBS[:9]
    seq = variable_rows(ColumnSpec("s", "sequence", "float32"), pa.array([[1.0], [2.0, 3.0]]))
    assert isinstance(seq, np.ndarray) and seq.dtype == object
    with pytest.raises(ValueError, match="column 'b': 1 null values"):
        variable_rows(ColumnSpec("b", "binary", "float32"), pa.array([b"x", None]))


def test_the_shuffle_and_bucketing_move_binary_rows_with_their_row():
    layout = Layout(
        {"y": torch.empty(0, dtype=torch.int64), "b": BinaryRows.empty()},
        [ColumnSpec("y", "scalar", "int64"), ColumnSpec("b", "binary", "float32")],
    )
    chunks = [
        layout.assemble({"y": np.arange(i, i + 4), "b": rows_of(BLOBS[i : i + 4])})
        for i in range(0, 40, 4)
    ]
    gen = torch.Generator().manual_seed(3)
    batches = list(
        buffered_batches(
            iter(chunks), [3] * 13 + [1], layout, [4] * 10, buffer_rows=9, generator=gen
        )
    )
    seen = []
    for batch in batches:
        assert isinstance(batch["b"], BinaryRows)
        seen += batch["y"].tolist()
        assert batch["b"].tolist() == [BLOBS[i] for i in batch["y"].tolist()]
    assert sorted(seen) == list(range(40)) and seen != list(range(40))
    rows = batches[0]
    permute_rows(rows, np.array([2, 0, 1]))
    assert rows["b"].tolist() == [BLOBS[i] for i in rows["y"].tolist()]
