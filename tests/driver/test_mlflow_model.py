"""mlflow_model: the signature of each kind of column, the input example read from a fit's
dataset, the requirements, which objects hold a TorchModel."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from spark_estimator import Store, TorchModel
from spark_estimator.driver import mlflow_model
from spark_estimator.shared.spec import IMAGE_FIELDS, ColumnSpec, DatasetInfo
from tests.conftest import linear_net

pytest.importorskip("mlflow")


def lengths(row, augment):
    return {name: torch.tensor([len(value)]) for name, value in row.items()}


def test_each_kind_of_feature_column_has_its_type_in_the_signature():
    kinds = {
        "n": ["scalar", "float32"],
        "v": ["vector", "float32"],
        "tokens": ["sequence", "int64"],
        "content": ["binary", "float32"],
        "text": ["string", "float32"],
        "image": ["image", "float32"],
    }
    model = TorchModel(
        model=linear_net(),
        feature_cols=list(kinds),
        output_cols=["score", "embedding"],
        output_shapes=[[1], [4]],
        feature_kinds=kinds,
        decode_fn=lengths,  # strings need one
    )
    signature = mlflow_model.infer_signature(model)
    inputs = {c["name"]: c for c in signature.inputs.to_dict()}
    assert {n: c["type"] for n, c in inputs.items()} == {
        "n": "double",
        "v": "array",
        "tokens": "array",
        "content": "binary",
        "text": "string",
        "image": "object",
        "path": "string",  # names the rows that fail to decode
    }
    assert inputs["v"]["items"] == {"type": "double"}
    assert inputs["tokens"]["items"] == {"type": "long"}
    assert set(inputs["image"]["properties"]) == set(IMAGE_FIELDS)  # Spark's image struct
    assert tuple(mlflow_model.IMAGE_STRUCT.names) == IMAGE_FIELDS
    assert inputs["path"]["required"] is False
    outputs = signature.outputs.to_dict()
    assert outputs == [
        {"type": "double", "name": "score", "required": True},
        {"type": "array", "items": {"type": "float"}, "name": "embedding", "required": True},
    ]


def test_without_the_fits_columns_the_example_types_the_signature_else_there_is_none():
    import pandas as pd

    model = TorchModel(model=linear_net(), feature_cols=["x"])  # built by hand: no kinds
    assert mlflow_model.infer_signature(model) is None
    example = mlflow_model.example_frame(pd.DataFrame({"x": [[1.0, 2, 3]], "y": [1]}), ["x"])
    assert list(example.columns) == ["x"]
    signature = mlflow_model.infer_signature(model, example)
    x = {"dtype": "float32", "shape": (-1, 3)}  # the example's first row holds 3 values
    assert signature.inputs.to_dict() == [{"name": "x", "type": "tensor", "tensor-spec": x}]
    with pytest.raises(ValueError, match=r"input_example: the feature columns \['x'\] are not"):
        mlflow_model.example_frame(pd.DataFrame({"z": [1.0]}), ["x"])


def test_numbers_arrays_and_vectors_of_known_widths_have_a_tensor_signature():
    """MLflow checks a tensor a column at once, an array of a column signature row by row;
    the widths are the fit's, else input_shapes', else the example's; unknown: columns."""
    kinds = {"n": ["scalar", "float64"], "x": ["array", "float64"], "v": ["vector", "float64"]}
    model = TorchModel(
        model=linear_net(),
        feature_cols=list(kinds),
        feature_kinds=kinds,
        feature_lengths={"x": 3, "v": 4},
        dtype="float64",
    )
    inputs = mlflow_model.infer_signature(model).inputs
    assert inputs.is_tensor_spec() and inputs.input_names() == ["n", "x", "v"]
    assert [(t.type.name, t.shape) for t in inputs.inputs] == [
        ("float64", (-1,)),
        ("float64", (-1, 3)),
        ("float64", (-1, 4)),
    ]
    shaped = TorchModel(
        model=linear_net(),
        feature_cols=["x"],
        feature_kinds={"x": ["array", "float32"]},
        input_shapes=[[1, 2, 2]],
    )
    [tensor] = mlflow_model.infer_signature(shaped).inputs.inputs
    assert (tensor.type.name, tensor.shape) == ("float32", (-1, 4))  # a row's values
    unknown = TorchModel(
        model=linear_net(), feature_cols=["x"], feature_kinds={"x": ["array", "float32"]}
    )
    assert mlflow_model.infer_signature(unknown).inputs.to_dict() == [
        {"type": "array", "items": {"type": "double"}, "name": "x", "required": True}
    ]


def dataset(tmp_path, table: pa.Table, kind: str) -> tuple[Store, DatasetInfo]:
    store = Store.create(str(tmp_path / "store"))
    (tmp_path / "store" / "data" / "train").mkdir(parents=True)
    pq.write_table(table, tmp_path / "store" / "data" / "train" / "part-0.parquet")
    info = DatasetInfo(
        path=store.join("data"),
        features=[ColumnSpec("x", kind, "float32")],
        labels=[ColumnSpec("y", "scalar", "float32")],
        files={"train": [("train/part-0.parquet", [0]), ("train/part-0.parquet", [3])]},
    )
    return store, info


def test_the_input_example_is_a_fits_first_rows_of_its_feature_columns(tmp_path):
    table = pa.table({"x": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], "y": [1.0, 2.0, 3.0]})
    store, info = dataset(tmp_path, table, "array")
    example = mlflow_model.example_rows(store, info, ["x"])
    assert list(example.columns) == ["x"]
    assert [list(v) for v in example["x"]] == [[1.0, 2.0], [3.0, 4.0]]


def test_ml_vectors_of_a_table_read_in_place_give_no_example(tmp_path):
    vector = pa.struct(
        [
            ("type", pa.int8()),
            ("size", pa.int32()),
            ("indices", pa.list_(pa.int32())),
            ("values", pa.list_(pa.float64())),
        ]
    )
    rows = [{"type": 1, "size": None, "indices": None, "values": [1.0, 2.0]}] * 3
    table = pa.table({"x": pa.array(rows, vector), "y": [1.0, 2.0, 3.0]})
    store, info = dataset(tmp_path, table, "vector")
    assert mlflow_model.example_rows(store, info, ["x"]) is None


def test_requirements_pin_this_package_and_torch_without_its_local_label():
    tabular = TorchModel(
        model=linear_net(), feature_cols=["x"], feature_kinds={"x": ["array", "float32"]}
    )
    names = mlflow_model.default_requirements(tabular)
    assert names[0].startswith("spark-estimator==")
    assert f"torch=={torch.__version__.split('+')[0]}" in names
    assert not any(n.startswith(("Pillow", "simplejpeg")) for n in names)
    images = TorchModel(
        model=linear_net(), feature_cols=["c"], feature_kinds={"c": ["binary", "float32"]}
    )
    assert {n.split("==")[0] for n in mlflow_model.default_requirements(images)} >= {
        "Pillow",
        "simplejpeg",
    }


def test_what_is_given_replaces_or_adds_to_what_is_inferred(tmp_path):
    from mlflow.models import Model, ModelSignature
    from mlflow.types.schema import ColSpec, Schema

    model = TorchModel(
        model=linear_net(), feature_cols=["x"], feature_kinds={"x": ["array", "float32"]}
    )
    added = tmp_path / "added"
    mlflow_model.save_model(
        str(added), torch_model=model, extra_pip_requirements=["tokenizers==0.20.3"]
    )
    requirements = (added / "requirements.txt").read_text().split()
    assert "tokenizers==0.20.3" in requirements and any(
        r.startswith("torch==") for r in requirements
    )
    replaced = tmp_path / "replaced"
    signature = ModelSignature(outputs=Schema([ColSpec("double", "prediction")]))
    mlflow_model.save_model(
        str(replaced),
        torch_model=model,
        pip_requirements=["torch"],
        signature=signature,
        metadata={"team": "churn"},
    )
    assert "torch" in (replaced / "requirements.txt").read_text().split()
    assert "spark-estimator" not in (replaced / "requirements.txt").read_text()
    saved = Model.load(str(replaced / "MLmodel"))
    assert saved.signature.inputs is None and saved.metadata == {"team": "churn"}


def test_requirements_given_whole_and_added_to_at_once_are_refused(tmp_path):
    model = TorchModel(model=linear_net(), feature_cols=["x"])
    with pytest.raises(ValueError, match="pip_requirements, extra_pip_requirements: give one"):
        mlflow_model.save_model(
            str(tmp_path / "m"),
            torch_model=model,
            pip_requirements=["torch"],
            extra_pip_requirements=["tokenizers"],
        )


def test_a_tuning_result_gives_its_best_model_and_anything_else_is_refused():
    model = TorchModel(model=linear_net(), feature_cols=["x"])

    class Tuned:
        bestModel = model

    assert mlflow_model.torch_model_of(model) is model
    assert mlflow_model.torch_model_of(Tuned()) is model
    with pytest.raises(TypeError, match="model: a Linear is no TorchModel and holds none"):
        mlflow_model.torch_model_of(linear_net())
