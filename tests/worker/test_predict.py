"""Batched inference on Arrow batches, without Spark: the regression and class outputs."""

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
