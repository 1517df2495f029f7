"""fit() with the data-path parameters: readers, shuffling, caching, steps, transformations,
Parquet already in the store, and the legacy stack (pyspark 3.5 + petastorm)."""

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from pyspark.sql import functions as F

from spark_estimator import TorchModel
from spark_estimator.serialization import loads
from spark_estimator.spec import LoaderSpec
from spark_estimator.worker.petastorm_reader import require_petastorm
from tests.conftest import linear_net, make_estimator, regression_rows


def ranks(store, model):
    return store.read_json(store.join("runs", model.getRunId(), "ranks.json"))


def digest(store, model):
    return ranks(store, model)[0]["weights_digest"]


def write_parquet(store, relpath, table, **options):
    path = store.join(relpath)
    store.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with store.fs.open(path, "wb") as f:
        pq.write_table(table, f, **options)


def petastorm_available() -> bool:
    try:
        require_petastorm()
        return True
    except ImportError:
        return False


READERS = [
    "arrow",
    pytest.param(
        "petastorm",
        marks=pytest.mark.skipif(not petastorm_available(), reason="legacy stack only"),
    ),
]


@pytest.mark.legacy
@pytest.mark.parametrize("reader", READERS)
def test_fit_and_transform_with_each_reader(regression_df, store, reader):
    est = make_estimator(linear_net(), store, reader=reader, epochs=15, validation=0.2)
    model = est.fit(regression_df)
    history = model.getHistory()
    assert history[-1]["train"]["loss"] < 1e-2 and history[-1]["validation"]["loss"] < 1e-2
    out = model.transform(regression_df)
    assert out.select(F.max(F.abs(F.col("y") - F.col("prediction")))).first()[0] < 0.2
    summary = ranks(store, model)
    assert len({s["weights_digest"] for s in summary}) == 1
    assert sum(s["train_rows"] + s["validation_rows"] for s in summary) == 200


def test_loader_params_reach_the_executors(spark, regression_df, store):
    def keep(batch):
        return batch

    est = make_estimator(
        linear_net(),
        store,
        shuffle=False,
        shuffle_buffer_size=7,
        reader_num_workers=3,
        inmemory_cache_all=True,
        train_steps_per_epoch=4,
        validation_steps_per_epoch=2,
        transformation_fn=keep,
    )
    loader = est._validate(spark, regression_df).loader
    assert loader == LoaderSpec(
        reader="arrow",
        shuffle=False,
        shuffle_buffer_size=7,
        num_workers=3,
        inmemory_cache_all=True,
        train_steps_per_epoch=4,
        validation_steps_per_epoch=2,
        transformation_fn=loader.transformation_fn,
    )
    assert loads(loader.transformation_fn)({"y": 1}) == {"y": 1}


def test_in_memory_cache_trains_exactly_as_streaming(regression_df, store):
    streamed = make_estimator(linear_net(), store, shuffle_buffer_size=20).fit(regression_df)
    cached = make_estimator(
        linear_net(), store, shuffle_buffer_size=20, inmemory_cache_all=True
    ).fit(regression_df)
    assert digest(store, cached) == digest(store, streamed)
    whole_shard_buffer = make_estimator(linear_net(), store).fit(regression_df)
    assert digest(store, whole_shard_buffer) != digest(store, streamed)
    unshuffled = make_estimator(linear_net(), store, shuffle=False).fit(regression_df)
    assert digest(store, unshuffled) != digest(store, streamed)


def test_steps_per_epoch_bound_training_and_validation(regression_df, store):
    est = make_estimator(
        linear_net(),
        store,
        validation=0.25,
        train_steps_per_epoch=3,
        validation_steps_per_epoch=1,
        epochs=4,
    )
    model = est.fit(regression_df)
    summary = ranks(store, model)
    assert {s["steps_per_epoch"] for s in summary} == {3}
    assert {s["validation_batches_per_epoch"] for s in summary} == {1}
    assert len(model.getHistory()) == 4


def test_transformation_fn_is_applied_to_every_batch(regression_df, store):
    net = linear_net()
    torch.nn.init.zeros_(net.weight)
    torch.nn.init.zeros_(net.bias)

    def zero_labels(batch):
        return {**batch, "y": torch.zeros_like(batch["y"])}

    model = make_estimator(net, store, transformation_fn=zero_labels, validation=0.2).fit(
        regression_df
    )
    # a zero model on zero labels has zero loss and zero gradients: nothing moves
    assert all(h["train"]["loss"] == 0.0 == h["validation"]["loss"] for h in model.getHistory())
    assert not model.getModel().weight.any()


def test_transformation_fn_must_keep_the_rows(regression_df, store):
    est = make_estimator(
        linear_net(),
        store,
        num_proc=1,
        transformation_fn=lambda b: {k: v[:1] for k, v in b.items()},
    )
    with pytest.raises(Exception, match="transformation_fn: column 'x' has 1 rows"):
        est.fit(regression_df)


def test_float64_dtype_trains_a_double_model_that_transforms_float64_inputs(
    regression_df, store, tmp_path
):
    net = linear_net().double()
    model = make_estimator(net, store, dtype="float64", epochs=10).fit(regression_df)
    assert model.getHistory()[-1]["train"]["loss"] < 1e-2
    assert model.getModel().weight.dtype == torch.float64
    assert model.getDtype() == "float64"
    model.save(str(tmp_path / "model"))
    loaded = TorchModel.load(str(tmp_path / "model"))
    assert loaded.getDtype() == "float64"
    rows = loaded.transform(regression_df).orderBy("id").collect()
    x = torch.tensor([r.x for r in rows], dtype=torch.float64)
    expected = loaded.getModel()(x).squeeze(1).tolist()  # float32 inputs differ at ~1e-7
    assert [r.prediction for r in rows] == pytest.approx(expected, rel=1e-12, abs=0)


def test_fit_on_parquet_trains_on_a_materialized_dataset(regression_df, store):
    est = make_estimator(
        linear_net(),
        store,
        validation=0.25,
        epochs=10,
        partitions_per_process=3,
        row_group_size_mb=0.001,
        compression="gzip",
    )
    path = est.materialize(regression_df)
    files = store.read_json(f"{path}/_meta.json")["files"]
    assert len(files["train"]) == 3 * 2  # partitions_per_process x num_proc
    # the row-group size reaches the writer's options, which are part of the dataset key
    assert est.copy({est.row_group_size_mb: 64.0}).materialize(regression_df) != path
    first = pq.ParquetFile(f"{path}/{files['train'][0][0]}").metadata
    assert first.row_group(0).column(0).compression == "GZIP"
    model = est.fit_on_parquet(path)
    summary = ranks(store, model)
    assert sum(s["train_rows"] for s in summary) + sum(s["validation_rows"] for s in summary) == 200
    assert "validation" in model.getHistory()[-1]
    assert model.getHistory()[-1]["train"]["loss"] < 1e-2


def test_fit_on_parquet_trains_on_users_parquet_with_a_validation_folder(store):
    rows = regression_rows(120)
    frame = pd.DataFrame({"x": [r[0] for r in rows], "y": [r[1] for r in rows]})
    for name, part in (("train", frame[:100]), ("val", frame[100:])):
        table = pa.Table.from_pandas(part, preserve_index=False)
        write_parquet(store, f"mine/{name}/part-0.parquet", table, row_group_size=30)
    est = make_estimator(linear_net(), store, epochs=10)
    model = est.fit_on_parquet("mine/train", validation_path="mine/val", params={est.epochs: 12})
    summary = ranks(store, model)
    assert sum(s["train_rows"] for s in summary) == 100
    assert sum(s["validation_rows"] for s in summary) == 20
    assert len(model.getHistory()) == 12 and model.getHistory()[-1]["validation"]["loss"] < 1e-2


@pytest.mark.parametrize(
    "call,error,message",
    [
        (dict(path="nowhere"), ValueError, "path: 'nowhere' does not exist"),
        (dict(path="mine", validation_path="gone"), ValueError, "validation_path: 'gone'"),
        (dict(path="mine", params={"feature_cols": ["z"]}), ValueError, "feature_cols: column 'z'"),
        (
            dict(path="mine", params={"validation": 0.2}),
            ValueError,
            "validation: 0.2 splits a DataFrame",
        ),
    ],
)
def test_fit_on_parquet_rejects_bad_paths_and_columns(spark, store, call, error, message):
    write_parquet(store, "mine/part-0.parquet", pa.table({"x": [1.0, 2.0], "y": [0.0, 1.0]}))
    est = make_estimator(linear_net(1), store)
    params = call.pop("params", None)
    if params:
        params = {est.getParam(k): v for k, v in params.items()}
    with pytest.raises(error, match=message):
        est.fit_on_parquet(**call, params=params)


def test_fit_on_parquet_checks_footer_null_counts_row_lengths_and_completeness(
    spark, store, tmp_path
):
    from tests.conftest import write_id_dataset

    est = make_estimator(linear_net(1), store, num_proc=1)
    table = pa.table({"x": [1.0, 2.0, 3.0], "y": [0.0, None, 1.0]})
    write_parquet(store, "nulls/part-0.parquet", table, row_group_size=2)
    with pytest.raises(ValueError, match="label_cols: column 'y' has 1 null values in the Parquet"):
        est.fit_on_parquet("nulls")
    # a materialized dataset: input_shapes against the row lengths in its _meta.json
    data = write_id_dataset(tmp_path / "store" / "done", [4], 2)
    data.row_lengths = {"x": 2}
    store.write_json(store.join("done", "_meta.json"), data.to_json())
    with pytest.raises(ValueError, match=r"input_shapes: shape \[-1, 3\] has 3 elements per row"):
        est.fit_on_parquet("done", params={est.input_shapes: [[-1, 3]]})
    # a dataset folder without _meta.json is incomplete: never read
    write_parquet(store, "datasets/k/write-1/train/part-0.parquet", table)
    with pytest.raises(ValueError, match="path: 'datasets/k' is a dataset folder without _meta"):
        est.fit_on_parquet("datasets/k")
