import pytest
import torch

from spark_estimator.shared.spec import ColumnSpec
from spark_estimator.worker.loop.loss import BatchLoss, as_outputs, batch_metrics

Y = [ColumnSpec("y", "scalar", "float32")]
AB = [ColumnSpec("a", "scalar", "float32"), ColumnSpec("b", "scalar", "float32")]


def test_as_outputs():
    t = torch.zeros(2)
    assert as_outputs(t)[0] is t and len(as_outputs((t, t))) == 2
    with pytest.raises(TypeError, match="model: forward"):
        as_outputs({"a": t})


def test_float_labels_take_the_output_shape_instead_of_broadcasting():
    out3 = torch.tensor([[1.0], [3.0], [5.0]])
    loss3 = BatchLoss([torch.nn.MSELoss()], Y)([out3], [torch.tensor([1.0, 3.0, 5.0])])
    assert loss3.item() == 0.0  # with broadcasting this would be (0+4+16+4+0+4+16+4+0)/9


def test_class_index_labels_are_left_alone():
    out = torch.randn(4, 3)
    label = torch.tensor([0, 2, 1, 0])
    expected = torch.nn.functional.cross_entropy(out, label)
    spec = [ColumnSpec("y", "scalar", "int64")]
    assert torch.equal(BatchLoss([torch.nn.CrossEntropyLoss()], spec)([out], [label]), expected)


def test_one_term_per_label_column_each_with_its_own_loss_and_weight():
    outs = [torch.ones(2, 1), torch.zeros(2, 1)]
    labels = [torch.zeros(2), torch.full((2,), 2.0)]
    mse, l1 = torch.nn.MSELoss(), torch.nn.L1Loss()
    assert BatchLoss([mse, mse], AB)(outs, labels).item() == 1.0 + 4.0
    assert BatchLoss([mse, l1], AB)(outs, labels).item() == 1.0 + 2.0
    assert BatchLoss([mse, l1], AB, loss_weights=[0.5, 3.0])(outs, labels).item() == 0.5 + 6.0


def test_sample_weights_weight_each_row_of_an_unreduced_loss():
    out = torch.tensor([[1.0], [2.0], [4.0]])
    label = torch.zeros(3)
    weights = torch.tensor([1.0, 0.0, 0.5])
    loss = BatchLoss([torch.nn.MSELoss()], Y, weighted_rows=True)
    # mean over rows of weight * row loss: (1*1 + 0*4 + 0.5*16) / 3
    assert loss([out], [label], weights).item() == pytest.approx(9.0 / 3)
    assert loss([out], [label], torch.ones(3)).item() == pytest.approx(21.0 / 3)


def test_sample_weights_need_a_per_row_loss_function():
    def mean_loss(out, y):
        return ((out - y) ** 2).mean()

    loss = BatchLoss([mean_loss], Y, weighted_rows=True)
    with pytest.raises(ValueError, match="sample_weight_col: the loss for label column 'y'"):
        loss([torch.ones(3, 1)], [torch.zeros(3)], torch.ones(3))


def test_empty_batch_gives_a_zero_loss_connected_to_the_outputs():
    out = torch.zeros(0, 1, requires_grad=True)
    loss = BatchLoss([torch.nn.MSELoss()], Y)([out], [torch.zeros(0)])
    assert loss.item() == 0.0 and loss.requires_grad


def test_output_label_count_mismatch_names_label_cols():
    with pytest.raises(ValueError, match="label_cols: the model returned 1 outputs for 2"):
        BatchLoss([torch.nn.MSELoss()] * 2, AB)([torch.ones(2)], [torch.ones(2)] * 2)


def test_shape_mismatch_names_the_label_column_and_shapes():
    with pytest.raises(ValueError, match=r"loss: failed on output of shape \(2, 3\) .* 'y'"):
        BatchLoss([torch.nn.CrossEntropyLoss()], Y)([torch.ones(2, 3)], [torch.ones(5)])


def test_batch_metrics_per_metric_then_per_label():
    outs = [torch.tensor([[1.0], [3.0]]), torch.tensor([[0.0], [0.0]])]
    labels = [torch.tensor([1.0, 1.0]), torch.tensor([2.0, 4.0])]
    metrics = {
        "mae": lambda o, y: (o - y).abs().mean(),
        "label_mean": lambda o, y: y.float().mean().item(),  # numbers are accepted too
    }
    values = [v.item() for v in batch_metrics(metrics, outs, labels)]
    assert values == [1.0, 3.0, 1.0, 3.0]


def test_a_loss_function_taking_reduction_is_called_unreduced_with_sample_weights():
    out = torch.tensor([[0.9], [0.2], [0.6]])
    label = torch.tensor([1.0, 0.0, 0.0])
    weights = torch.tensor([1.0, 0.0, 0.5])
    function = BatchLoss([torch.nn.functional.binary_cross_entropy], Y, weighted_rows=True)
    module = BatchLoss([torch.nn.BCELoss()], Y, weighted_rows=True)
    rows = torch.nn.functional.binary_cross_entropy(out, label.view(3, 1), reduction="none")
    expected = (rows.view(3) * weights).mean()
    assert torch.allclose(function([out], [label], weights), expected)
    assert torch.allclose(module([out], [label], weights), expected)


def test_integer_labels_of_a_loss_on_float_targets_take_the_outputs_dtype():
    out = torch.tensor([[0.9], [0.2], [0.6]])
    label = torch.tensor([1, 0, 0])
    spec = [ColumnSpec("y", "scalar", "int64")]
    expected = torch.nn.functional.binary_cross_entropy(out, label.float().view(3, 1))
    loss = BatchLoss([torch.nn.BCELoss()], spec)
    assert torch.allclose(loss([out], [label]), expected)
    assert torch.allclose(loss([out], [label]), expected)  # and on every later batch
    weighted = BatchLoss([torch.nn.BCELoss()], spec, weighted_rows=True)
    assert torch.allclose(weighted([out], [label], torch.ones(3)), expected)


def test_integer_labels_a_loss_indexes_with_stay_integers():
    class_weight = torch.tensor([1.0, 3.0])

    def weighted_bce(out, y):  # y indexes class_weight: it must stay int64
        per_row = torch.nn.functional.binary_cross_entropy(
            out.view(-1), y.float(), reduction="none"
        )
        return (class_weight[y] * per_row).mean()

    out, label = torch.tensor([[0.9], [0.2]]), torch.tensor([1, 0])
    spec = [ColumnSpec("y", "scalar", "int64")]
    assert torch.allclose(BatchLoss([weighted_bce], spec)([out], [label]), weighted_bce(out, label))
