import pytest
import torch

from spark_estimator.spec import ColumnSpec
from spark_estimator.worker.train import as_outputs, compute_loss

Y = [ColumnSpec("y", "scalar", "float32")]


def test_as_outputs():
    t = torch.zeros(2)
    assert as_outputs(t)[0] is t and len(as_outputs((t, t))) == 2
    with pytest.raises(TypeError, match="model: forward"):
        as_outputs({"a": t})


def test_float_labels_take_the_output_shape_instead_of_broadcasting():
    out3 = torch.tensor([[1.0], [3.0], [5.0]])
    loss3 = compute_loss(torch.nn.MSELoss(), [out3], [torch.tensor([1.0, 3.0, 5.0])], Y)
    assert loss3.item() == 0.0  # with broadcasting this would be (0+4+16+4+0+4+16+4+0)/9


def test_class_index_labels_are_left_alone():
    out = torch.randn(4, 3)
    label = torch.tensor([0, 2, 1, 0])
    expected = torch.nn.functional.cross_entropy(out, label)
    spec = [ColumnSpec("y", "scalar", "int64")]
    assert torch.equal(compute_loss(torch.nn.CrossEntropyLoss(), [out], [label], spec), expected)


def test_one_term_per_label_column():
    outs = [torch.ones(2, 1), torch.zeros(2, 1)]
    labels = [torch.zeros(2), torch.zeros(2)]
    specs = [ColumnSpec("a", "scalar", "float32"), ColumnSpec("b", "scalar", "float32")]
    assert compute_loss(torch.nn.MSELoss(), outs, labels, specs).item() == 1.0


def test_output_label_count_mismatch_names_label_cols():
    with pytest.raises(ValueError, match="label_cols: the model returned 1 outputs for 2"):
        compute_loss(torch.nn.MSELoss(), [torch.ones(2)], [torch.ones(2)] * 2, Y * 2)


def test_shape_mismatch_names_the_label_column_and_shapes():
    with pytest.raises(ValueError, match=r"loss: failed on output of shape \(2, 3\) .* 'y'"):
        compute_loss(torch.nn.CrossEntropyLoss(), [torch.ones(2, 3)], [torch.ones(5)], Y)
