"""Batched inference on Arrow batches, without Spark: the regression and class outputs."""

import logging
import math

import pyarrow as pa
import pytest
import torch

from spark_estimator.shared.serialization import dumps, pack_functions
from spark_estimator.shared.spec import ColumnSpec, DecodeSpec
from spark_estimator.worker.predict import class_columns, predict_batches


def rows(column: pa.Array) -> list:
    return column.to_pylist()


def test_class_logits_give_softmax_argmax_and_centred_logits():
    logits = torch.tensor([[1.0, 2.0, 0.5], [3.0, -1.0, 0.0]])
    raw, prob, pred = class_columns(logits)
    assert raw.type == pa.list_(pa.float64()) and pred.type == pa.float64()
    expected = torch.softmax(logits.double(), 1)
    assert rows(prob) == [pytest.approx(r) for r in expected.tolist()]
    assert rows(pred) == [1.0, 0.0]
    centred = logits.double() - logits.double().mean(1, keepdim=True)
    assert rows(raw) == [pytest.approx(r) for r in centred.tolist()]
    assert torch.allclose(torch.softmax(torch.tensor(rows(raw), dtype=torch.float64), 1), expected)


@pytest.mark.parametrize("shape", [(4,), (4, 1)])
def test_one_binary_logit_gives_sigmoid_and_minus_z_z(shape):
    z = torch.tensor([-2.0, 0.0, 0.5, 3.0])
    raw, prob, pred = class_columns(z.reshape(shape))
    p = torch.sigmoid(z.double())
    assert rows(prob) == [pytest.approx([1 - a, a]) for a in p.tolist()]
    assert rows(raw) == [pytest.approx([-a, a]) for a in z.tolist()]
    assert rows(pred) == [0.0, 0.0, 1.0, 1.0]  # z = 0 (p = 0.5) is class 0, as in Spark


@pytest.mark.parametrize("shape", [(4, 3, 2), (4, 0), ()])
def test_other_output_shapes_are_refused(shape):
    with pytest.raises(ValueError, match=r"classification: the model's output has shape"):
        class_columns(torch.zeros(shape))


class TwoHeads(torch.nn.Module):
    def forward(self, x):
        return x, x


def batch() -> pa.RecordBatch:
    x = pa.array([[1.0, 0.0], [0.0, 2.0]], pa.list_(pa.float32()))
    return pa.RecordBatch.from_arrays([x, pa.array(["a", "b"])], names=["x", "tag"])


def predict(model, classification=True, names=("raw", "prob", "pred")):
    return list(
        predict_batches(
            iter([batch()]),
            model_bytes=dumps(model, "model"),
            features=[ColumnSpec("x", "array", "float32")],
            input_shapes=None,
            output_cols=list(names),
            scalar_outputs=[] if classification else [False] * len(names),
            classification=classification,
        )
    )


def test_predict_batches_appends_the_three_class_columns():
    net = torch.nn.Linear(2, 3)
    (out,) = predict(net)
    assert out.schema.names == ["x", "tag", "raw", "prob", "pred"]
    assert rows(out.column("tag")) == ["a", "b"]
    logits = net(torch.tensor([[1.0, 0.0], [0.0, 2.0]])).double()
    assert rows(out.column("pred")) == logits.argmax(1).double().tolist()
    expected = torch.softmax(logits, 1).tolist()
    assert rows(out.column("prob")) == [pytest.approx(r) for r in expected]


def test_a_model_with_two_outputs_is_refused_for_classification():
    with pytest.raises(ValueError, match="classification: the model returned 2 outputs"):
        predict(TwoHeads())


class BatchMean(torch.nn.Module):
    def forward(self, x):
        return x.mean(0, keepdim=True)


@pytest.mark.parametrize("classification", [True, False])
def test_outputs_without_one_row_per_input_row_are_refused(classification):
    names = ("raw", "prob", "pred") if classification else ("prediction",)
    with pytest.raises(ValueError, match=r"output '(raw|prediction)' has shape \[1, 2\] for a "):
        predict(BatchMean(), classification, names)


def test_nulls_in_transform_are_refused_saying_to_drop_them_before_transform():
    text = pa.array(["a b", None, "c"])
    x = pa.array([1.0, None, 2.0], pa.float32())
    record = pa.RecordBatch.from_arrays([text, x], names=["text", "x"])

    def outputs(features, **decoding):
        return list(
            predict_batches(
                iter([record]),
                model_bytes=dumps(torch.nn.Identity(), "model"),
                features=features,
                input_shapes=None,
                output_cols=["prediction"],
                scalar_outputs=[False],
                **decoding,
            )
        )

    decode = DecodeSpec(
        functions=pack_functions(decode_fn=lambda row, augment: {"text": torch.ones(2)})
    )
    with pytest.raises(
        ValueError, match=r"column 'text': 1 null values; drop or fill them before transform"
    ):
        outputs([ColumnSpec("text", "string", "float32")], decode=decode, fit_labels=[])
    with pytest.raises(
        ValueError, match=r"column 'x': 1 null values; drop or fill them before transform"
    ):
        outputs([ColumnSpec("x", "scalar", "float32")])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("logits", ["classes", "one"])
def test_rows_of_logits_that_are_not_finite_get_no_class(bad, logits):
    """A row whose logits are not all finite gets prediction NaN, not a class chosen by
    argmax over NaN (class 0) or by the sign of an infinite logit; its raw and
    probability columns are as computed."""
    z = torch.tensor([[2.0, 1.0], [bad, 0.0], [-1.0, 3.0]])
    if logits == "one":
        z = z[:, 0]
    raw, prob, pred = class_columns(z)
    got = rows(pred)
    assert got[0] == (0.0 if logits == "classes" else 1.0) and math.isnan(got[1])
    assert got[2] == (1.0 if logits == "classes" else 0.0)
    assert len(rows(prob)[1]) == 2 and len(rows(raw)[1]) == 2


class Scale(torch.nn.Module):
    """[B, 2] (x) and [B] (a) -> two class logits, x * a; finite where both are."""

    def forward(self, x, a):
        return x * a.unsqueeze(1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("column", ["x", "a"])
def test_non_finite_features_give_prediction_nan_and_a_warning_naming_the_column(
    bad, column, caplog
):
    x = [[1.0, 2.0], [3.0, 1.0], [1.0, 1.0]]
    a = [1.0, 1.0, 2.0]
    if column == "x":
        x[1][0] = bad
    else:
        a[1] = bad
    record = pa.RecordBatch.from_arrays(
        [pa.array(x, pa.list_(pa.float32())), pa.array(a, pa.float64())], names=["x", "a"]
    )
    with caplog.at_level(logging.WARNING, logger="spark_estimator"):
        (out,) = predict_batches(
            iter([record]),
            model_bytes=dumps(Scale(), "model"),
            features=[ColumnSpec("x", "array", "float32"), ColumnSpec("a", "scalar", "float32")],
            input_shapes=None,
            output_cols=["raw", "prob", "pred"],
            scalar_outputs=[],
            classification=True,
        )
    pred = rows(out.column("pred"))
    assert pred[0] == 1.0 and math.isnan(pred[1]) and pred[2] == 0.0
    (record,) = [r for r in caplog.records if "NaN or infinite" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert f"feature_cols: column '{column}' holds NaN or infinite values in 1 of 3 rows" in (
        record.getMessage()
    )


def test_finite_features_log_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="spark_estimator"):
        predict(torch.nn.Linear(2, 3))
    assert not [r for r in caplog.records if "NaN or infinite" in r.getMessage()]
