"""fit() with bucket_by_length: a ragged token-id column trained with and without length
bucketing (the padding share the training summary reports), and what the driver refuses."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from spark_estimator import LightningEstimator, TorchEstimator
from tests.conftest import make_estimator


class MeanOfEmbeddings(torch.nn.Module):
    """An EmbeddingBag-like mean over the row's own (masked) embeddings, then a Linear."""

    def __init__(self, vocabulary: int = 50, width: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocabulary, width)
        self.out = torch.nn.Linear(width, 1)

    def forward(self, ids, mask):
        weights = mask.unsqueeze(-1).float()
        mean = (self.embed(ids) * weights).sum(1) / weights.sum(1).clamp(min=1)
        return self.out(mean)


def ragged_rows(n: int = 1000, seed: int = 0):
    """Token ids of random lengths 1..200; the label is the share of ids below 25."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        ids = rng.integers(0, 50, int(rng.integers(1, 201)))
        rows.append((ids.tolist(), float((ids < 25).mean())))
    return rows


def test_bucketing_pads_less_and_trains_every_row_once(spark, store):
    rows = ragged_rows()
    df = spark.createDataFrame(rows, "ids array<int>, y double")
    summaries = {}
    for bucket in (False, True):  # the second fit finds the dataset in the store
        net = MeanOfEmbeddings()
        est = make_estimator(
            net,
            store,
            feature_cols=["ids"],
            batch_size=32,
            epochs=1,
            verbose=False,
            bucket_by_length=bucket,
        )
        model = est.fit(df)
        assert np.isfinite(model.getHistory()[-1]["train"]["loss"])
        summaries[bucket] = model.getTrainingSummary()["padding"]
    values = sum(len(ids) for ids, _ in rows)
    # each row once in the epoch: the rows' own values are all the values there are
    assert summaries[False]["values"] == summaries[True]["values"] == values
    plain, bucketed = summaries[False]["share"], summaries[True]["share"]
    print(f"padding share: {plain:.4f} without bucketing, {bucketed:.4f} with")
    assert plain > 0.4
    assert bucketed < plain / 4


def test_bucketing_is_refused_without_a_sequence_or_string_column(spark, store):
    df = spark.createDataFrame([(float(i), 2.0 * i) for i in range(8)], "x double, y double")
    est = make_estimator(store=store, bucket_by_length=True, net=torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="bucket_by_length: .*no feature or label column"):
        est.fit(df)


def test_bucketing_is_refused_without_shuffle(spark, store):
    df = spark.createDataFrame([([1, 2], 1.0), ([3], 2.0)], "x array<int>, y double")
    est = make_estimator(store=store, bucket_by_length=True, shuffle=False)
    with pytest.raises(ValueError, match="bucket_by_length: .*shuffle=True"):
        est.fit(df)


def test_fit_on_parquet_refuses_bucketing_of_numbers_once_it_reads_the_schema(spark, store):
    path = store.join("numbers/part-0.parquet")
    store.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with store.fs.open(path, "wb") as f:
        pq.write_table(pa.table({"x": [1.0, 2.0], "y": [2.0, 4.0]}), f)
    est = make_estimator(store=store, bucket_by_length=True, net=torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="bucket_by_length: .*'x' \\(scalar\\)"):
        est.fit_on_parquet("numbers")


def test_both_estimators_take_the_param():
    assert TorchEstimator(bucket_by_length=True).getBucketByLength() is True
    assert LightningEstimator(bucket_by_length=True).getBucketByLength() is True
    assert TorchEstimator().getBucketByLength() is False


def test_arrays_of_one_length_are_trained_on_with_a_warning(caplog):
    from spark_estimator.driver.fit_checks import check_bucketing_data
    from spark_estimator.shared.spec import ColumnSpec, DatasetInfo

    fixed = DatasetInfo(
        path="d",
        features=[ColumnSpec("x", "array", "float32")],
        labels=[ColumnSpec("y", "scalar", "float32")],
        files={},
    )
    with caplog.at_level("WARNING", logger="spark_estimator.driver.fit"):
        check_bucketing_data(fixed, shuffle=True)
    assert "bucket_by_length: every array column's rows have one length ('x')" in caplog.text
    caplog.clear()
    ragged = DatasetInfo("d", [ColumnSpec("x", "sequence", "int64")], fixed.labels, files={})
    check_bucketing_data(ragged, shuffle=True)
    assert not caplog.text
