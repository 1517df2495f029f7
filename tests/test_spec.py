import torch

from spark_estimator.spec import ColumnSpec, DatasetInfo


def test_column_dtypes():
    assert ColumnSpec("c", "scalar", True).torch_dtype == torch.int64
    assert ColumnSpec("v", "vector", False).torch_dtype == torch.float32


def test_dataset_info_json_round_trip_and_row_counts():
    info = DatasetInfo(
        path="/s/datasets/k",
        features=[ColumnSpec("x", "array", False)],
        labels=[ColumnSpec("y", "scalar", True)],
        files={"train": [("train/a.parquet", [4, 4, 1]), ("train/b.parquet", [2])]},
    )
    meta = info.to_json()
    assert meta["rows"] == {"train": 11, "validation": 0}
    back = DatasetInfo.from_json(info.path, meta, reused=True)
    assert back.features == info.features and back.labels == info.labels
    assert back.files == info.files and back.reused and back.rows("train") == 11
