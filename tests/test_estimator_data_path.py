"""fit() with the data-path parameters: readers, shuffling, caching, steps, transformations,
Parquet already in the store, and the legacy stack (pyspark 3.5 + petastorm)."""

import json
import logging
import os
import posixpath
import threading
from collections import Counter

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from pyspark.sql import functions as F

from spark_estimator import TorchModel, TrainingError
from spark_estimator.callbacks import Callback
from spark_estimator.shared.packages import require_petastorm
from spark_estimator.store import DatasetFolder
from tests.conftest import linear_net, make_estimator, regression_rows


def ranks(store, model):
    return store.read_json(store.run(model.getRunId()).ranks)


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


class ReadLog(Callback):
    """What a rank's readers did, seen on the executor: every Parquet row group read
    (pyarrow's ``ParquetFile.read_row_group``, wrapped for the fit) with the epoch it was
    read in (0: before the first), and the reader threads alive while reading. Written to
    ``<folder>/rank-<r>.json`` at the end of training."""

    def __init__(self, folder):
        self.folder = str(folder)

    def on_train_begin(self, state):
        self.epoch, self.reads, self.threads = 0, [], set()
        self.original = opened, read = pq.ParquetFile.__init__, pq.ParquetFile.read_row_group

        def open_named(parquet, source, *args, **kwargs):
            opened(parquet, source, *args, **kwargs)
            parquet.logged_name = str(getattr(source, "path", source))

        def read_logged(parquet, index, *args, **kwargs):
            self.reads.append([self.epoch, getattr(parquet, "logged_name", None), index])
            alive = (t.name for t in threading.enumerate())
            self.threads.update(n for n in alive if n.startswith("spark-estimator-read_"))
            return read(parquet, index, *args, **kwargs)

        pq.ParquetFile.__init__, pq.ParquetFile.read_row_group = open_named, read_logged

    def on_epoch_begin(self, epoch, state):
        self.epoch = epoch

    def on_train_end(self, state):
        pq.ParquetFile.__init__, pq.ParquetFile.read_row_group = self.original
        with open(os.path.join(self.folder, f"rank-{state.rank}.json"), "w") as f:
            json.dump({"reads": self.reads, "threads": sorted(self.threads)}, f)


def read_logs(folder) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank-*.json"))]


def groups_read(log) -> Counter:
    """How many times the rank read each row group."""
    return Counter((path, index) for _, path, index in log["reads"])


def test_loader_params_reach_the_executors(regression_df, store, tmp_path):
    est = make_estimator(
        linear_net(),
        store,
        validation=0.5,  # about 50 rows a rank of each split: 4 batches of 16 in a pass
        reader_num_workers=3,
        inmemory_cache_all=True,
        device_cache_fraction=0.0,  # streaming: the readers work while training
        train_steps_per_epoch=3,
        validation_steps_per_epoch=2,
        callbacks=[ReadLog(tmp_path)],
    )
    model = est.fit(regression_df)
    summary = ranks(store, model)
    assert {n for s in summary for n in s["batches_per_epoch"]} == {3}
    assert {s["validation_batches_per_epoch"] for s in summary} == {2}
    logs = read_logs(tmp_path)
    assert len(logs) == 2
    for log in logs:
        # three reader threads per reader; the cache read every row group once, in all epochs
        assert log["threads"] == [f"spark-estimator-read_{i}" for i in range(3)]
        assert log["reads"] and set(groups_read(log).values()) == {1}
    # shuffle and shuffle_buffer_size: test_in_memory_cache_trains_exactly_as_streaming;
    # transformation_fn: test_transformation_fn_is_applied_to_every_batch


def test_in_memory_cache_trains_exactly_as_streaming(regression_df, store, tmp_path):
    streamed_reads, cached_reads = tmp_path / "streamed", tmp_path / "cached"
    streamed_reads.mkdir(), cached_reads.mkdir()
    streamed = make_estimator(
        linear_net(),
        store,
        shuffle_buffer_size=20,
        device_cache_fraction=0.0,
        callbacks=[ReadLog(streamed_reads)],
    ).fit(regression_df)
    cached = make_estimator(
        linear_net(),
        store,
        shuffle_buffer_size=20,
        inmemory_cache_all=True,
        device_cache_fraction=0.0,
        callbacks=[ReadLog(cached_reads)],
    ).fit(regression_df)
    assert digest(store, cached) == digest(store, streamed)
    # the executors read: streaming, every row group in every epoch (3); cached, each once
    # during the first epoch and nothing after
    for log in read_logs(streamed_reads):
        assert min(groups_read(log).values()) >= 3
        assert {epoch for epoch, _, _ in log["reads"]} >= {2, 3}
    for log in read_logs(cached_reads):
        assert log["reads"] and set(groups_read(log).values()) == {1}
        assert max(epoch for epoch, _, _ in log["reads"]) <= 1
    whole_shard_buffer = make_estimator(linear_net(), store).fit(regression_df)
    assert digest(store, whole_shard_buffer) != digest(store, streamed)
    unshuffled = make_estimator(linear_net(), store, shuffle=False).fit(regression_df)
    assert digest(store, unshuffled) != digest(store, streamed)


def test_a_shard_held_on_the_device_trains_exactly_as_streaming_it(regression_df, store, caplog):
    caplog.set_level(logging.INFO, logger="spark_estimator.driver.fit_report")
    held = make_estimator(linear_net(), store, validation=0.25).fit(regression_df)
    streamed = make_estimator(linear_net(), store, validation=0.25, device_cache_fraction=0.0).fit(
        regression_df
    )
    over = make_estimator(linear_net(), store, validation=0.25, device_cache_fraction=1e-12).fit(
        regression_df
    )
    placements = [[r["data_placement"] for r in ranks(store, m)] for m in (held, streamed, over)]
    assert all(p.startswith("held on cpu: ") for p in placements[0])
    assert set(placements[1]) == {"streaming: device_cache_fraction is 0"}
    assert all(p.startswith("streaming: the shard needs ") for p in placements[2])
    assert all("over the budget" in p for p in placements[2])
    logged = [
        r.getMessage() for r in caplog.records if r.name == "spark_estimator.driver.fit_report"
    ]
    assert "ranks 0, 1: data streaming: device_cache_fraction is 0" in logged
    # the same rows in the same batches (the shard fits the shuffle buffer): the same model
    assert digest(store, held) == digest(store, streamed) == digest(store, over)
    for key in ("train_rows", "validation_rows", "batches_per_epoch"):
        assert [r[key] for r in ranks(store, held)] == [r[key] for r in ranks(store, streamed)]
    for a, b in zip(held.getHistory(), streamed.getHistory(), strict=True):
        assert (a["train"], a["validation"]) == (b["train"], b["validation"])


class CountWhatRan(Callback):
    """Counts the training forward passes and optimizer steps of each epoch on its rank
    (hooks on the model and the optimizer), and adds them to the epoch's record."""

    def on_train_begin(self, state):
        self.batches = self.steps = 0

        def forward(module, args, output):
            self.batches += module.training

        def step(optimizer, args, kwargs):
            self.steps += 1

        state.model.register_forward_hook(forward)
        state.optimizer.register_step_post_hook(step)

    def on_epoch_begin(self, epoch, state):
        self.batches = self.steps = 0

    def on_epoch_end(self, epoch, logs, state):
        logs["ran"] = {"batches": self.batches, "optimizer_steps": self.steps}


@pytest.mark.parametrize(
    "steps,group,batch_size",
    [
        (3, 2, 10),  # an epoch of 3 batches: groups of 2 and 1
        (4, 2, 20),  # 5-batch passes: groups cross the pass boundaries
    ],
)
def test_train_steps_per_epoch_counts_batches_with_gradient_accumulation(
    regression_df, store, steps, group, batch_size
):
    est = make_estimator(
        linear_net(),
        store,
        validation=0.25 if steps == 3 else None,
        batch_size=batch_size,
        train_steps_per_epoch=steps,
        backward_passes_per_step=group,
        validation_steps_per_epoch=1,
        callbacks=[CountWhatRan()],
        epochs=4,
    )
    model = est.fit(regression_df)
    optimizer_steps = -(-steps // group)
    ran = {"batches": steps, "optimizer_steps": optimizer_steps}
    assert [h["ran"] for h in model.getHistory()] == [ran] * 4
    summary = ranks(store, model)
    assert {tuple(s["batches_per_epoch"]) for s in summary} == {(steps,) * 4}
    assert {tuple(s["optimizer_steps_per_epoch"]) for s in summary} == {(optimizer_steps,) * 4}
    expected = 1 if steps == 3 else 0
    assert {s["validation_batches_per_epoch"] for s in summary} == {expected}


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
    files = store.read_json(DatasetFolder(path).meta)["files"]
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


def test_fit_on_parquet_reads_double_class_labels_as_class_indices(spark, store):
    """Doubles of whole numbers (StringIndexer's labels, written by Spark) train a
    CrossEntropyLoss classifier with classification=True, as in fit(df); a label that is
    not a whole number is named."""
    rows = regression_rows(120)
    labels = [float((r[1] > 0) + (r[1] > 2)) for r in rows]
    frame = pd.DataFrame({"x": [r[0] for r in rows], "label": labels})
    write_parquet(store, "classes/part-0.parquet", pa.Table.from_pandas(frame), row_group_size=40)
    net = linear_net(3, 3)
    est = make_estimator(
        net,
        store,
        optimizer=torch.optim.Adam(net.parameters(), lr=0.05),
        loss=torch.nn.CrossEntropyLoss(),
        label_cols=["label"],
        classification=True,
        epochs=8,
    )
    model = est.fit_on_parquet("classes")
    assert model.getHistory()[-1]["train"]["loss"] < model.getHistory()[0]["train"]["loss"] / 2
    frame.loc[7, "label"] = 0.5
    write_parquet(store, "halves/part-0.parquet", pa.Table.from_pandas(frame), row_group_size=40)
    with pytest.raises(TrainingError, match="column 'label': class indices must be whole numbers"):
        est.copy({est.epochs: 1}).fit_on_parquet("halves")


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
    store.write_json(DatasetFolder(store.join("done")).meta, data.to_json())
    with pytest.raises(ValueError, match=r"input_shapes: shape \[-1, 3\] has 3 elements per row"):
        est.fit_on_parquet("done", params={est.input_shapes: [[-1, 3]]})
    # a dataset folder without _meta.json is incomplete: never read
    incomplete = store.dataset("k")
    part = incomplete.part("write-1", "train", 0)
    write_parquet(store, posixpath.relpath(part, store.root), table)
    relative = posixpath.relpath(incomplete.path, store.root)  # "datasets/k", as a user names it
    with pytest.raises(ValueError, match=f"path: '{relative}' is a dataset folder without _meta"):
        est.fit_on_parquet(relative)
