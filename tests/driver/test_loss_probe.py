import re

import pytest
import torch

from spark_estimator.driver.loss_probe import check_loss
from spark_estimator.shared.serialization import dumps
from spark_estimator.shared.spec import ColumnSpec
from tests.driver.test_validate_training import bundle as training_bundle

X = [ColumnSpec("x", "array", "float32")]
Y = [ColumnSpec("y", "scalar", "float32")]
INT_Y = [ColumnSpec("y", "scalar", "int64")]
W = ColumnSpec("w", "scalar", "float32")
KNOWN = {"x": 3}  # the row lengths a dataset records


def bundle(net=None, loss=None, **objects):
    """The executors' pickle of a sigmoid regression trained with BCE (``objects`` override)."""
    net = net if net is not None else torch.nn.Sequential(torch.nn.Linear(3, 1), torch.nn.Sigmoid())
    return training_bundle(net, loss=loss if loss is not None else torch.nn.BCELoss(), **objects)


def probe(bundle_, labels=Y, sample_weight=None, row_lengths=KNOWN, **kw):
    kw = {"input_shapes": None, "loss_weights": None, "transformation_fn": None, **kw}
    return check_loss(bundle_, X, labels, sample_weight, row_lengths=row_lengths, **kw)


def mean_loss(output, label):
    return ((output.view(-1) - label) ** 2).mean()


def test_a_loss_without_per_row_values_is_refused_with_sample_weights():
    assert probe(bundle(loss=mean_loss)) is True  # fine without sample weights
    with pytest.raises(ValueError, match=r"sample_weight_col: the loss for label column 'y'"):
        probe(bundle(loss=mean_loss), sample_weight=W)


def test_losses_with_reduction_pass_with_sample_weights_and_stay_as_given():
    loss = torch.nn.BCELoss()
    assert probe(bundle(loss=loss), sample_weight=W) is True
    assert loss.reduction == "mean"  # the probe ran on a copy
    assert probe(bundle(loss=torch.nn.functional.binary_cross_entropy), sample_weight=W)


def test_integer_labels_pass_with_float_and_class_index_losses():
    assert probe(bundle(), labels=INT_Y, sample_weight=W) is True
    scores = torch.nn.Linear(3, 4)
    assert probe(bundle(net=scores, loss=torch.nn.CrossEntropyLoss()), labels=INT_Y) is True


def test_a_loss_of_its_own_failing_on_the_labels_is_a_warning_naming_loss_and_the_column(
    caplog,
):
    def scores_loss(output, label):  # class scores against float labels
        return torch.nn.functional.cross_entropy(output, label)

    scores = torch.nn.Linear(3, 4)
    assert probe(bundle(net=scores, loss=scores_loss)) is True
    assert re.search(r"loss: failed on output of shape \(2, 4\) .* 'y'", caplog.text)
    assert "training goes on" in caplog.text


@pytest.mark.parametrize(
    "net,loss,labels,message",
    [
        (  # class scores against float labels
            torch.nn.Linear(3, 4),
            torch.nn.CrossEntropyLoss(),
            Y,
            r"loss: failed on output of shape \(2, 4\) and label column 'y' of shape \(2,\) "
            r"\(RuntimeError: expected .*\), tried on the driver on 2 rows \(of zeros\); torch's "
            r"CrossEntropyLoss fails the same way in training: this loss takes class indices: "
            r"give label column 'y' as whole numbers of an integer type, e\.g\. "
            r"df\.withColumn\('y', F\.col\('y'\)\.cast\('long'\)\)",
        ),
        (  # 3 outputs for a scalar label: torch would broadcast them (a UserWarning)
            torch.nn.Linear(3, 3),
            torch.nn.MSELoss(),
            [ColumnSpec("y", "array", "float32")],
            r"loss: failed on output of shape \(2, 3\) and label column 'y' of shape \(2, 1\) "
            r"\(UserWarning: Using a target size .*\); torch's MSELoss fails the same way in "
            r"training: the model returns 3 values per row",
        ),
        (  # a function of torch.nn.functional, as a scalar label
            torch.nn.Linear(3, 3),
            torch.nn.functional.mse_loss,
            Y,
            r"torch's mse_loss fails the same way in training: the model returns 3 values",
        ),
    ],
)
def test_torchs_own_loss_failing_on_the_shapes_is_refused_saying_what_to_change(
    net, loss, labels, message
):
    lengths = {**KNOWN, "y": 1}
    with pytest.raises(ValueError, match=message):
        probe(bundle(net=net, loss=loss), labels=labels, row_lengths=lengths)


def test_class_scores_too_few_for_the_labels_largest_value_are_refused():
    two_classes = bundle(net=torch.nn.Linear(3, 2), loss=torch.nn.CrossEntropyLoss())
    assert probe(two_classes, labels=INT_Y) is True  # zeros: class 0 exists
    assert probe(two_classes, labels=INT_Y, label_ranges={"y": [0, 1]}) is True
    with pytest.raises(ValueError) as e:
        probe(two_classes, labels=INT_Y, label_ranges={"y": [0, 2]})
    message = str(e.value)
    assert message.startswith("loss: failed on output of shape (2, 2) and label column 'y'")
    assert "Target 2 is out of bounds" in message
    assert "label 'y' its smallest and largest values in the data, 0 and 2" in message
    assert "label column 'y' holds class indices up to 2, so the model must return [B, 3]" in (
        message
    )


def test_a_loss_that_needs_a_rank_is_not_refused(caplog):
    def rank_loss(output, label):  # runs only where a process group exists
        import torch.distributed as dist

        return ((output.view(-1) - label) ** 2).mean() * (dist.get_rank() + 1)

    assert probe(bundle(loss=rank_loss)) is True
    assert "loss: failed on output" in caplog.text


def test_array_columns_of_unknown_length_wait_for_the_data_or_input_shapes():
    bad = bundle(loss=mean_loss)
    assert probe(bad, sample_weight=W, row_lengths={}) is False  # nothing ran
    with pytest.raises(ValueError, match="sample_weight_col: the loss"):
        probe(bad, sample_weight=W, row_lengths={}, input_shapes=[[-1, 3]])


def test_what_fails_before_the_loss_is_left_to_the_executors():
    class NeedsPositive(torch.nn.Linear):
        def forward(self, x):
            assert (x > 0).all(), "real rows only"
            return super().forward(x)

    assert probe(bundle(net=NeedsPositive(3, 1), loss=mean_loss), sample_weight=W) is True

    def broken(batch):
        raise RuntimeError("needs real rows")

    assert probe(bundle(loss=mean_loss), sample_weight=W, transformation_fn=dumps(broken, "t"))


def test_a_transformation_fn_is_applied_to_the_probe_batch(caplog):
    def to_classes(batch):  # the loss gets the labels the transformation makes
        return {**batch, "y": batch["y"].long()}

    scores = bundle(net=torch.nn.Linear(3, 4), loss=torch.nn.CrossEntropyLoss())
    transform = dumps(to_classes, "transformation_fn")
    assert probe(scores, transformation_fn=transform) is True
    assert "loss: failed" not in caplog.text
    with pytest.raises(ValueError, match="loss: failed on output"):
        probe(scores)


def horovod_style(df):  # Horovod's transformation_fn: a pandas DataFrame of NumPy values
    df["y"] = df["y"].astype("float32") * 2
    return df


def test_a_transformation_fn_written_for_horovod_is_refused_saying_what_it_receives():
    transform = dumps(horovod_style, "transformation_fn")
    with pytest.raises(TypeError) as e:
        probe(bundle(loss=mean_loss), transformation_fn=transform)
    message = str(e.value)
    assert message.startswith("transformation_fn: fails on a batch as it is given here")
    assert "'Tensor' object has no attribute 'astype'" in message
    assert "{'x': float32 [2, 3], 'y': float32 [2]}" in message  # what it receives
    assert "runs on a pandas DataFrame" in message  # what it was written for


def test_a_transformation_fn_returning_no_dict_is_refused_on_the_driver():
    as_list = dumps(lambda batch: list(batch.values()), "transformation_fn")
    with pytest.raises(TypeError, match="transformation_fn: must return a dict of tensors"):
        probe(bundle(loss=mean_loss), transformation_fn=as_list)


def test_a_torch_layer_that_does_not_fit_the_columns_is_refused_naming_columns_and_layer():
    net = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    with pytest.raises(ValueError) as e:
        probe(bundle(net=net, loss=torch.nn.MSELoss()), row_lengths={"x": 4})
    message = str(e.value)
    assert message.startswith(
        "model: layer '0' (Linear(in_features=5, out_features=16, bias=True)) does not fit "
        "the feature columns 'x' [B, 4] (no input_shapes): RuntimeError: mat1 and mat2 "
        "shapes cannot be multiplied (2x4 and 5x16)"
    )
    assert "\n" not in message


def test_a_layer_deep_in_the_model_is_named_by_its_path_with_the_input_shapes():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten())

        def forward(self, x):
            return self.encoder(x).sum(dim=1, keepdim=True)

    with pytest.raises(ValueError) as e:
        probe(
            bundle(net=Net(), loss=torch.nn.MSELoss()),
            row_lengths={"x": 64},
            input_shapes=[[1, 8, 8]],
        )
    message = str(e.value)
    assert message.startswith("model: layer 'encoder.0' (Conv2d(3, 4, kernel_size=(3, 3)")
    assert "'x' [B, 1, 8, 8] (input_shapes=[[1, 8, 8]])" in message
    assert "to have 3 channels, but got 1 channels" in message


def test_what_may_need_a_rank_stays_a_warning_for_the_executors():
    class OwnCheck(torch.nn.Linear):  # the model's own code raising: not a layer of torch
        def forward(self, x):
            raise RuntimeError(f"expected size 5, got {x.shape}")

    class ZerosOnly(torch.nn.Module):  # a layer failing only on zeros (rows picked by value)
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 1)

        def forward(self, x):
            return self.fc(x if x.any() else x[:, :2])

    def a_function(x):  # a function of torch.nn.functional, not a layer
        return torch.nn.functional.linear(x, torch.zeros(1, 5))

    class Function(torch.nn.Linear):
        def forward(self, x):
            return a_function(x)

    for net in (OwnCheck(3, 1), ZerosOnly(), Function(3, 1)):
        assert probe(bundle(net=net, loss=mean_loss)) is True


def test_a_model_built_on_the_meta_device_is_left_to_the_executors():
    with torch.device("meta"):
        net = torch.nn.Linear(5, 1)
    assert probe(bundle(net=net, loss=mean_loss)) is True
