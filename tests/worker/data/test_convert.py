import numpy as np
import pyarrow as pa
import pytest
import torch

from spark_estimator.worker.data.convert import (
    column_to_tensor,
    reshape_input,
    tensor_to_arrow,
)

VECTOR = pa.struct(
    [
        pa.field("type", pa.int8(), nullable=False),
        pa.field("size", pa.int32()),
        pa.field("indices", pa.list_(pa.int32())),
        pa.field("values", pa.list_(pa.float64())),
    ]
)


def test_scalars_and_chunked_arrays():
    col = pa.chunked_array([[1, 2], [3]])
    t = column_to_tensor("x", col, torch.float32)
    assert t.dtype == torch.float32 and t.tolist() == [1.0, 2.0, 3.0]
    assert column_to_tensor("y", pa.array([4, 5]), torch.int64).dtype == torch.int64


def test_fixed_length_lists_become_2d_and_are_writable():
    t = column_to_tensor("x", pa.array([[1.0, 2.0], [3.0, 4.0]]), torch.float32)
    assert t.shape == (2, 2) and t[1, 0] == 3.0
    t[0, 0] = 9.0  # torch needs writable memory; Arrow's buffers are read-only


def test_sliced_list_arrays_respect_offsets():
    arr = pa.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]).slice(1, 2)
    assert column_to_tensor("x", arr, torch.float32).tolist() == [[3.0, 4.0], [5.0, 6.0]]


def test_varying_lengths_name_the_column():
    with pytest.raises(ValueError, match="column 'x': arrays have varying lengths"):
        column_to_tensor("x", pa.array([[1.0], [1.0, 2.0]]), torch.float32)


def test_nulls_name_the_column():
    with pytest.raises(ValueError, match="column 'y': 1 null values"):
        column_to_tensor("y", pa.array([1.0, None]), torch.float32)
    with pytest.raises(ValueError, match="column 'z': arrays contain null elements"):
        column_to_tensor("z", pa.array([[1.0, None]]), torch.float32)


def test_dense_and_sparse_vectors_decode_together():
    vectors = pa.array(
        [
            {"type": 1, "size": None, "indices": None, "values": [1.0, 2.0, 3.0]},
            {"type": 0, "size": 3, "indices": [0, 2], "values": [4.0, 5.0]},
            {"type": 0, "size": 3, "indices": [], "values": []},
        ],
        type=VECTOR,
    )
    t = column_to_tensor("v", vectors, torch.float32)
    np.testing.assert_array_equal(t.numpy(), [[1, 2, 3], [4, 0, 5], [0, 0, 0]])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_vectors_decode_to_the_requested_dtype_without_rounding_through_float32(dtype):
    big = 2.0**24 + 1  # not a float32: rounds to 2**24
    vectors = pa.array(
        [
            {"type": 1, "size": None, "indices": None, "values": [big, 0.1]},
            {"type": 0, "size": 2, "indices": [1], "values": [big]},
        ],
        type=VECTOR,
    )
    t = column_to_tensor("v", vectors, dtype)
    expected = torch.tensor([[big, 0.1], [0.0, big]], dtype=torch.float64).to(dtype)
    assert t.tolist() == expected.tolist() and t.dtype == dtype
    if dtype == torch.float64:  # what a float64 model computes on it
        assert (t[0, 0] - 2**24).item() == 1.0 and t[0, 1].item() == 0.1


def test_vectors_of_different_sizes_are_rejected():
    vectors = pa.array(
        [
            {"type": 1, "size": None, "indices": None, "values": [1.0]},
            {"type": 0, "size": 3, "indices": [0], "values": [4.0]},
        ],
        type=VECTOR,
    )
    with pytest.raises(ValueError, match="column 'v'"):
        column_to_tensor("v", vectors, torch.float32)


def test_reshape_input_errors_name_input_shapes_and_column():
    x = torch.zeros(4, 64)
    assert reshape_input("f", x, [-1, 1, 8, 8]).shape == (4, 1, 8, 8)
    assert reshape_input("f", x, [1, 8, 8]).shape == (4, 1, 8, 8)
    assert reshape_input("f", x[:0], [1, 8, 8]).shape == (0, 1, 8, 8)
    assert reshape_input("f", x, None) is x
    with pytest.raises(ValueError, match="input_shapes: .* column 'f' has rows of length 64"):
        reshape_input("f", x, [-1, 3, 5])


def test_tensor_to_arrow_scalar_and_array_outputs():
    scalar = tensor_to_arrow(torch.tensor([[1.5], [2.5]]), as_scalar=True)
    assert scalar.type == pa.float64() and scalar.to_pylist() == [1.5, 2.5]
    arr = tensor_to_arrow(torch.arange(6.0).reshape(2, 3), as_scalar=False)
    assert arr.type == pa.list_(pa.float32())
    assert arr.to_pylist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
