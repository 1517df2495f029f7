import torch

from spark_estimator.shared.spec import ColumnSpec, DatasetInfo


def test_column_dtypes():
    assert ColumnSpec("c", "scalar", "int64").torch_dtype == torch.int64
    assert ColumnSpec("v", "vector", "float32").torch_dtype == torch.float32
    assert ColumnSpec("d", "scalar", "float64").torch_dtype == torch.float64
    assert ColumnSpec("c", "scalar", "int64").integral


def test_dataset_info_json_round_trip_and_row_counts():
    info = DatasetInfo(
        path="/s/datasets/k",
        features=[ColumnSpec("x", "array", "float32")],
        labels=[ColumnSpec("y", "scalar", "int64")],
        files={"train": [("train/a.parquet", [4, 4, 1]), ("train/b.parquet", [2])]},
        source={"plan": "Range (0, 11)"},
        row_lengths={"x": 4},
        write_id="write-1",
    )
    meta = info.to_json()
    assert meta["rows"] == {"train": 11, "validation": 0}
    back = DatasetInfo.from_json(info.path, meta, reused=True)
    assert back.features == info.features and back.labels == info.labels
    assert back.row_lengths == {"x": 4} and back.write_id == "write-1"
    assert back.row_length(info.features[0]) == 4 and back.row_length(info.labels[0]) == 1
    assert back.files == info.files and back.reused and back.rows("train") == 11
    assert back.source == info.source and back.columns == info.features + info.labels
