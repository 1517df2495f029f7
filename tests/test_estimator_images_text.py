"""Images and text straight from Spark tables (local[4], real binaryFile, image and string
DataFrames, real Parquet): fit, transform, save/load, bad input, exact resume with
augmentation on, Lightning."""

import io
import re
import uuid
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from pyspark.sql import functions as F

from spark_estimator import Store, TorchEstimator, TorchModel, TrainingError
from spark_estimator.decoding import decode_image, random_crop, random_flip
from tests.faults import Fault
from tests.processes import decode_workers

Image = pytest.importorskip("PIL.Image", reason="needs Pillow (the vision extra)")

SIZE = 12  # the images' side


def write_digits(folder: Path, count: int = 300, broken: int | None = None) -> Path:
    """scikit-learn's digits as SIZE x SIZE grayscale images in ``folder/<label>/``, every
    other one a JPEG, the rest PNG; image ``broken`` holds bytes that are no image."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    for i, (pixels, label) in enumerate(zip(digits.images[:count], digits.target[:count])):
        image = Image.fromarray((pixels * 15).astype(np.uint8)).resize((SIZE, SIZE))
        (folder / str(label)).mkdir(parents=True, exist_ok=True)
        suffix = "jpg" if i % 2 else "png"
        path = folder / str(label) / f"{i:04d}.{suffix}"
        if i == broken:
            path.write_bytes(b"no image here")
        else:
            image.save(path, quality=95)
    return folder


def image_df(spark, folder: Path):
    df = spark.read.format("binaryFile").option("recursiveFileLookup", "true").load(str(folder))
    return df.withColumn("label", F.regexp_extract("path", r"/(\d)/[^/]+$", 1).cast("long"))


class SmallCNN(torch.nn.Module):
    """uint8 images [B, 1, H, W] -> 10 class logits."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv = torch.nn.Conv2d(1, 8, 3, padding=1)
        self.out = torch.nn.Linear(8 * 4 * 4, 10)

    def forward(self, images):
        x = torch.relu(self.conv(images.float() / 255))
        return self.out(torch.nn.functional.adaptive_avg_pool2d(x, 4).flatten(1))


def decode_digit(row, augment):
    image = decode_image(row["content"], mode="L")
    if augment is not None:
        image = random_flip(random_crop(image, SIZE, augment, padding=1), augment, p=0.2)
    return {"content": image}


def estimator(net, store, lr: float, **params) -> TorchEstimator:
    """A fit of ``net`` by 2 processes with Adam and cross entropy; ``params`` override."""
    base = dict(
        model=net,
        optimizer=torch.optim.Adam(net.parameters(), lr=lr),
        loss=torch.nn.CrossEntropyLoss(),
        label_cols=["label"],
        num_proc=2,
        store=store,
        use_gpu=False,
        verbose=False,
    )
    return TorchEstimator(**{**base, **params})


def image_estimator(store, **params) -> TorchEstimator:
    base = dict(
        feature_cols=["content"], decode_fn=decode_digit, batch_size=16, epochs=10, validation=0.2
    )
    return estimator(SmallCNN(), store, 0.02, **{**base, **params})


def accuracy(model, df) -> float:
    scored = model.transform(df).select("label", "prediction").collect()
    return float(np.mean([int(np.argmax(r.prediction)) == r.label for r in scored]))


@pytest.fixture(scope="module")
def digits_folder(tmp_path_factory):
    return write_digits(tmp_path_factory.mktemp("digits"))


def test_a_cnn_trains_on_a_binary_file_dataframe_of_jpeg_and_png_with_augmentation(
    spark, store, digits_folder, tmp_path
):
    df = image_df(spark, digits_folder)
    model = image_estimator(store).fit(df)
    history = model.getHistory()
    assert history[-1]["validation"]["loss"] < history[0]["validation"]["loss"] / 2
    assert accuracy(model, df) > 0.8
    summary = model.getTrainingSummary()
    assert summary["rows_skipped"] == 0 and "padding" not in summary
    # the images were written as they are: their bytes, no pixels; the paths beside them
    dataset = Path(store.datasets)
    files = list(dataset.rglob("*.parquet"))
    schema = pq.read_schema(files[0])
    assert str(schema.field("content").type) == "binary" and "path" in schema.names
    stored = sum(f.stat().st_size for f in files)
    pixels = 300 * SIZE * SIZE * 3 * 4  # float32 RGB, as a decoded dataset would hold them
    assert stored < pixels / 3
    # transform decodes without augmentation, also after save and load
    model.write().overwrite().save(str(tmp_path / "model"))
    loaded = TorchModel.load(str(tmp_path / "model"))
    first = [r.prediction for r in model.transform(df).orderBy("path").limit(20).collect()]
    again = [r.prediction for r in loaded.transform(df).orderBy("path").limit(20).collect()]
    assert first == again


def test_spark_image_source_columns_train_with_the_default_decoding(spark, store, tmp_path):
    folder = tmp_path / "pngs"
    folder.mkdir()
    for i in range(40):  # bright squares (class 1) and dark ones (class 0), RGB
        value = 200 if i % 2 else 30
        Image.new("RGB", (8, 8), (value, value // 2, 255 - value)).save(folder / f"{i % 2}-{i}.png")
    df = spark.read.format("image").load(str(folder))
    df = df.withColumn("label", F.regexp_extract("image.origin", r"/(\d)-", 1).cast("long"))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.out = torch.nn.Linear(3, 2)

        def forward(self, image):  # uint8 [B, 3, 8, 8], RGB
            return self.out(image.float().mean((2, 3)) / 255)

    est = estimator(Net(), store, 0.1, feature_cols=["image"], epochs=15, batch_size=8)
    model = est.fit(df)
    scored = model.transform(df).select("label", "prediction").collect()
    assert all(int(np.argmax(r.prediction)) == r.label for r in scored)
    # RGB order: the blue channel of a bright square is dark
    first = df.filter("label = 1").select("image").first().image
    pixel = np.frombuffer(first.data, np.uint8)[:3]  # Spark stores BGR
    assert pixel.tolist() == [55, 100, 200]


def char_ids(text: str) -> torch.Tensor:
    """A tokenizer for the tests: one id per character."""
    return torch.tensor([ord(c) % 128 for c in text], dtype=torch.int64)


class BagOfTokens(torch.nn.Module):
    """(ids [B, L], mask [B, L]) -> logits: the mean of the row's own embeddings."""

    def __init__(self, classes: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(128, 16)
        self.out = torch.nn.Linear(16, classes)

    def forward(self, ids, mask):
        vectors = self.embed(ids) * mask[..., None]
        return self.out(vectors.sum(1) / mask.sum(1, keepdim=True).clamp(min=1))


def sentences(count: int = 200):
    rng = np.random.default_rng(0)
    good, bad = ["good", "great", "fine", "nice"], ["bad", "awful", "poor", "sad"]
    rows = []
    for i in range(count):
        label = i % 2
        words = rng.choice(good if label else bad, size=rng.integers(1, 6))
        rows.append((" ".join(words) + " day" * int(rng.integers(0, 4)), label))
    return rows


def test_a_string_column_trains_with_a_decode_fn_and_dynamic_padding(spark, store):
    df = spark.createDataFrame(sentences(), "text string, label long")
    decode = {"decode_fn": lambda row, augment: {"text": char_ids(row["text"])}}
    params = dict(feature_cols=["text"], epochs=8, batch_size=16)
    est = estimator(BagOfTokens(), store, 0.05, **params, **decode)
    model = est.fit(df)
    padding = model.getTrainingSummary()["padding"]
    assert 0 < padding["values"] < padding["padded"] and 0 < padding["share"] < 1
    scored = model.transform(df).select("label", "prediction").collect()
    assert np.mean([int(np.argmax(r.prediction)) == r.label for r in scored]) > 0.95


def test_token_id_arrays_of_varying_length_train_with_per_token_labels(spark, store):
    """array<int> features of varying length are sequences (no decode_fn needed); ragged
    integer labels are padded with -100, which CrossEntropyLoss ignores."""
    rng = np.random.default_rng(1)
    rows = []
    for _ in range(120):
        ids = rng.integers(1, 20, size=int(rng.integers(2, 9))).tolist()
        rows.append((ids, [int(i >= 10) for i in ids]))  # tag each token: >= 10 or not
    df = spark.createDataFrame(rows, "ids array<int>, tags array<int>")

    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed = torch.nn.Embedding(20, 2)

        def forward(self, ids, mask):
            return self.embed(ids)  # [B, L, 2]

    def token_loss(logits, tags):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tags.flatten())

    params = dict(loss=token_loss, feature_cols=["ids"], label_cols=["tags"], epochs=10)
    model = estimator(Tagger(), store, 0.1, batch_size=16, **params).fit(df)
    assert model.getHistory()[-1]["train"]["loss"] < 0.1
    embed = model.getModel().embed.weight
    assert (embed[10:].argmax(1) == 1).all() and (embed[1:10].argmax(1) == 0).all()
    out = model.transform(df).collect()  # padded to each Arrow batch's longest row
    longest = max(len(r.ids) for r in out)
    assert all(len(r.prediction) == 2 * longest for r in out)


def test_bad_images_are_named_with_their_path_or_skipped_and_counted(spark, tmp_path):
    folder = write_digits(tmp_path / "digits", count=60, broken=7)
    df = image_df(spark, folder)
    store = Store.create(str(tmp_path / "store"))
    params = dict(epochs=1, validation=None)
    with pytest.raises(TrainingError) as info:
        image_estimator(store, **params).fit(df)
    message = str(info.value).splitlines()[0]
    assert re.match(r"BadRow: decode_fn: row \d+ of the split \(path file:.*/0007\.jpg\)", message)
    assert "could not be decoded from column 'content' (" in message
    assert "bad_rows='skip'" in message
    model = image_estimator(store, bad_rows="skip", **params).fit(df)
    assert model.getTrainingSummary()["rows_skipped"] == 1
    assert sum(r["train_rows"] for r in store.read_json(store.run(model.getRunId()).ranks)) == 60


def test_variable_columns_are_refused_on_the_driver_where_they_cannot_work(spark, store):
    df = spark.createDataFrame(sentences(10), "text string, label long")
    net = BagOfTokens()
    base = dict(
        model=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss=torch.nn.CrossEntropyLoss(),
        feature_cols=["text"],
        label_cols=["label"],
        num_proc=1,
        store=store,
        use_gpu=False,
    )
    cases = [
        ({}, "decode_fn: feature column 'text' holds strings"),
        (dict(decode_fn=lambda r, a: r, reader="petastorm"), None),
        (dict(decode_fn=lambda r, a: r, bad_rows="ignore"), "bad_rows: must be one of"),
        (dict(decode_fn=lambda r, a: r, decode_device="cuda"), "decode_device: 'cuda' decodes"),
    ]
    group = f"refused-{uuid.uuid4().hex}"
    spark.sparkContext.setJobGroup(group, "variable columns refused")
    try:
        for params, message in cases:
            if message is None:  # petastorm: refused as not importable here, or as numeric-only
                with pytest.raises((ValueError, ImportError), match=r"^reader: "):
                    TorchEstimator(**{**base, **params}).fit(df)
                continue
            with pytest.raises(ValueError, match=re.escape(message)):
                TorchEstimator(**{**base, **params}).fit(df)
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
    assert list(spark.sparkContext.statusTracker().getJobIdsForGroup(group)) == []
    assert not Path(store.datasets).exists() or not any(Path(store.datasets).iterdir())


def test_a_fit_started_again_goes_on_exactly_with_augmentation_on(
    spark, store, digits_folder, tmp_path
):
    """Each row's crop and flip come from (seed, epoch, row): the launch after a lost
    process, from a commit inside the epoch, trains as the run that lost nothing."""
    df = image_df(spark, digits_folder)
    params = dict(epochs=3, commit_every_steps=2, validation=None)
    clean = image_estimator(store, run_id="clean", **params).fit(df)
    fault = Fault("kill", rank=1, epoch=2, marker=tmp_path / "m", after_batches=3)
    # decoded by worker processes this time: the killed rank's workers end with it
    workers = dict(decode_pool="processes", decode_workers=2)
    resumed = image_estimator(store, run_id="lost", callbacks=[fault], **params, **workers).fit(df)
    assert (tmp_path / "m").exists()
    assert not rank_decode_workers()
    assert resumed.getTrainingSummary()["resumed_from_commit"] == {"epoch": 2, "step": 2}
    want, got = clean.getModel().state_dict(), resumed.getModel().state_dict()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6)
    for a, b in zip(resumed.getHistory(), clean.getHistory()):
        assert a["train"]["loss"] == pytest.approx(b["train"]["loss"], abs=1e-6)


def test_a_lightning_module_gets_images_and_sequence_masks_in_its_batches(spark, store):
    pl = pytest.importorskip("lightning.pytorch")
    from spark_estimator import LightningEstimator

    rows = [(text, label, ["neg", "pos"][label]) for text, label in sentences(60)]
    df = spark.createDataFrame(rows, "text string, label long, topic string")

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = BagOfTokens()

        def forward(self, ids, mask):
            return self.net(ids, mask)

        def training_step(self, batch, batch_idx):
            # a label column of strings reaches the module as the batch's list of strings
            assert batch["topic"] == [["neg", "pos"][i] for i in batch["label"].tolist()]
            logits = self(batch["text"], batch["text_mask"])
            return torch.nn.functional.cross_entropy(logits, batch["label"])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.05)

    model = LightningEstimator(
        model=Module(),
        feature_cols=["text"],
        label_cols=["label", "topic"],
        # row.get: transform's rows hold no labels, and the labels it returns are dropped
        decode_fn=lambda row, augment: {"text": char_ids(row["text"]), "topic": row.get("topic")},
        epochs=3,
        batch_size=16,
        num_proc=2,
        store=store,
        use_gpu=False,
        verbose=False,
    ).fit(df)
    assert len(model.getHistory()) == 3
    assert len(model.transform(df.limit(4)).collect()) == 4


def test_fit_on_parquet_reads_binary_and_string_columns_as_a_fit_does(spark, store):
    import pyarrow as pa

    rows = sentences(40)
    images = []
    for _, label in rows:
        out = io.BytesIO()
        Image.new("L", (SIZE, SIZE), 40 + 150 * label).save(out, format="PNG")
        images.append(out.getvalue())
    table = pa.table(
        {
            "content": pa.array(images, pa.binary()),
            "text": [t for t, _ in rows],
            "label": pa.array([label for _, label in rows], pa.int64()),
        }
    )
    with store.open_atomic(store.join("mine/part-0.parquet")) as f:
        pq.write_table(table, f, row_group_size=10)
    model = image_estimator(store, epochs=2, validation=None).fit_on_parquet("mine")
    assert len(model.getHistory()) == 2
    with pytest.raises(ValueError, match="decode_fn: feature column 'text' holds strings"):
        image_estimator(
            store, feature_cols=["text"], decode_fn=None, validation=None
        ).fit_on_parquet("mine")


def test_string_labels_and_gpu_decoding_without_gpus_are_refused_on_the_driver(spark, store):
    labelled = spark.createDataFrame([(1.0, "pos"), (0.0, "neg")] * 4, "x double, topic string")
    images = spark.createDataFrame(
        [(bytearray(b"\xff\xd8 a jpeg"), 1)] * 4, "content binary, label long"
    )
    net = torch.nn.Linear(1, 2)
    base = dict(
        model=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss=torch.nn.CrossEntropyLoss(),
        num_proc=1,
        store=store,
    )
    gpu = "decode_device: 'cuda' decodes JPEG images on the GPU of each process, but"
    images_params = dict(feature_cols=["content"], label_cols=["label"], decode_device="cuda")
    cases = [
        (
            labelled,
            dict(feature_cols=["x"], label_cols=["topic"]),
            "label_cols: column 'topic' holds strings, which the loss cannot take; index them "
            "first with pyspark.ml.feature.StringIndexer",
        ),
        (images, dict(images_params, use_gpu=False), f"{gpu} use_gpu=False trains on the CPU"),
        (
            images,
            images_params,
            f"{gpu} this fit trains on the CPU: Spark gives its tasks no GPU",
        ),
    ]
    group = f"refused-{uuid.uuid4().hex}"
    spark.sparkContext.setJobGroup(group, "refused on the driver")
    try:
        for df, params, message in cases:
            with pytest.raises(ValueError, match="^" + re.escape(message)):
                TorchEstimator(**{**base, **params}).fit(df)
        model = TorchModel(model=SmallCNN(), feature_cols=["content"], decode_device="cuda")
        with pytest.raises(
            ValueError, match=r"^decode_device: .* but transform's tasks get no GPU"
        ):
            model.transform(images)
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
    assert list(spark.sparkContext.statusTracker().getJobIdsForGroup(group)) == []
    assert not Path(store.datasets).exists() or not any(Path(store.datasets).iterdir())


def test_a_decode_fn_maps_string_labels_and_transform_says_when_it_reads_one(
    spark, store, tmp_path
):
    topics = ["sports", "weather"]
    rows = [(text, topics[label]) for text, label in sentences(80)]
    df = spark.createDataFrame(rows, "text string, topic string")

    def decode(row, augment):
        return {"text": char_ids(row["text"]), "topic": torch.tensor(topics.index(row["topic"]))}

    params = dict(feature_cols=["text"], label_cols=["topic"], epochs=8, batch_size=16)
    model = estimator(BagOfTokens(), store, 0.05, decode_fn=decode, **params).fit(df)
    model.write().overwrite().save(str(tmp_path / "model"))
    loaded = TorchModel.load(str(tmp_path / "model"))
    for fitted in (model, loaded):
        with pytest.raises(Exception) as info:
            fitted.transform(df.limit(2)).collect()
        assert (
            "decode_fn: read 'topic', a label column of the fit; transform's rows hold only the "
            "variable feature columns (text)"
        ) in str(info.value)

    def decode_either(row, augment):
        out = {"text": char_ids(row["text"])}
        if "topic" in row:
            out["topic"] = torch.tensor(topics.index(row["topic"]))
        return out

    scored = model.setDecodeFn(decode_either).transform(df).collect()
    right = [topics[int(np.argmax(r.prediction))] == r.topic for r in scored]
    assert np.mean(right) > 0.95


def test_a_corrupt_image_in_parquet_read_in_place_or_from_the_store_is_named_by_its_path(
    spark, tmp_path
):
    import pyarrow as pa

    folder = write_digits(tmp_path / "digits", count=40, broken=7)
    files = sorted(folder.rglob("*.*"))
    table = pa.table(
        {
            "content": pa.array([f.read_bytes() for f in files], pa.binary()),
            "path": [f"file:{f}" for f in files],
            "label": pa.array([int(f.parent.name) for f in files], pa.int64()),
        }
    )
    pq.write_table(table, tmp_path / "table.parquet", row_group_size=10)
    store = Store.create(str(tmp_path / "store"))
    with store.open_atomic(store.join("mine/part-0.parquet")) as f:
        pq.write_table(table, f, row_group_size=10)
    broken = next(f for f in files if f.stem == "0007")
    for fit in (
        lambda est: est.fit(spark.read.parquet(str(tmp_path / "table.parquet"))),
        lambda est: est.fit_on_parquet("mine"),
    ):
        with pytest.raises(TrainingError) as info:
            fit(image_estimator(store, epochs=1, validation=None, data_copy="never"))
        message = str(info.value).splitlines()[0]
        assert re.match(
            r"BadRow: decode_fn: row \d+ of the split \(path file:.*/0007\.jpg\)", message
        )
        assert f"file:{broken}" in message


def rank_decode_workers() -> list[str]:
    """This test's ranks' decode worker processes (once they had a few seconds to end); not
    transform's, which Spark's Python workers keep, nor another pytest worker's."""
    import time

    for _ in range(50):
        found = decode_workers(" rank-")
        if not found:
            return []
        time.sleep(0.2)
    return list(found.values())


def test_worker_processes_fit_and_transform_as_threads_do_started_once_per_python_worker(
    spark, store, digits_folder, tmp_path, caplog
):
    import logging

    caplog.set_level(logging.INFO, logger="spark_estimator.worker")
    df = image_df(spark, digits_folder)
    marks = tmp_path / "inits"
    marks.mkdir()

    def init():  # a decode worker's start: where (its Python worker), and that it ran
        import os

        (marks / f"{os.getppid()}-{os.getpid()}").write_text("")
        print(f"decode worker {os.getpid()} ready")

    params = dict(epochs=2, validation=0.2, decode_init_fn=init)
    threads = image_estimator(store, decode_pool="threads", **params).fit(df)
    processes = image_estimator(store, decode_pool="processes", decode_workers=2, **params).fit(df)
    for name, value in threads.getModel().state_dict().items():
        assert torch.equal(processes.getModel().state_dict()[name], value), name
    losses = [[h[s]["loss"] for s in ("train", "validation")] for h in threads.getHistory()]
    assert [
        [h[s]["loss"] for s in ("train", "validation")] for h in processes.getHistory()
    ] == losses
    decoding = processes.getTrainingSummary()["decoding"]
    assert [(d["rank"], d["pool"], d["workers"]) for d in decoding] == [
        (0, "processes", 2),
        (1, "processes", 2),
    ]
    for d in decoding:  # each worker's memory: shared with its fork server, less its own
        assert len(d["worker_uss_mib"]) == len(d["worker_start_seconds"]) == 2
        assert all(uss < rss / 2 for uss, rss in zip(d["worker_uss_mib"], d["worker_rss_mib"]))
        assert all(rss > 50 for rss in d["worker_rss_mib"])
    assert threads.getTrainingSummary()["decoding"][0]["pool"] == "threads"
    # with threads once in each rank, with processes once in each worker of each rank
    assert len(list(marks.iterdir())) == 2 + 2 * 2
    assert not rank_decode_workers()
    # a worker's prints reach the driver as its rank's
    lines = [r.getMessage() for r in caplog.records if r.name == "spark_estimator.worker"]
    pids = [m.name.split("-")[1] for m in marks.iterdir()]
    assert sum(f"] decode worker {pid} ready" in line for pid in pids for line in lines) == 6
    # transform: the same predictions, the workers started once per Spark Python worker
    many = df.repartition(8)
    want = {r.path: r.prediction for r in threads.transform(many).collect()}
    for mark in marks.iterdir():
        mark.unlink()
    got = {r.path: r.prediction for r in processes.setDecodeWorkers(1).transform(many).collect()}
    assert got == want
    parents = [m.name.split("-")[0] for m in marks.iterdir()]
    assert len(parents) == len(set(parents)) < 8  # fewer starts than partitions


def test_a_decode_worker_killed_mid_fit_fails_it_naming_the_cause_and_leaves_nothing(
    spark, store, digits_folder, tmp_path
):
    df = image_df(spark, digits_folder)
    marker = tmp_path / "killed"

    def dies_once(row, augment):  # the 40th row a worker decodes in training kills it
        import os
        import signal

        global decoded_here
        decoded_here = globals().get("decoded_here", 0) + (augment is not None)
        if decoded_here == 40 and not marker.exists():
            marker.write_text("")
            os.kill(os.getpid(), signal.SIGKILL)
        return decode_digit(row, augment)

    params = dict(epochs=2, validation=None, decode_pool="processes", decode_workers=1)
    with pytest.raises(TrainingError) as info:
        image_estimator(store, decode_fn=dies_once, **params).fit(df)
    message = str(info.value).splitlines()[0]
    assert re.match(
        r"DecodeWorkerDied: decode worker 0 \(pid \d+\) of rank \d died while decoding the "
        r"batch whose first row is \d+ of the split \(path file:.*\.(jpg|png)\): killed by "
        r"SIGKILL \(out of memory, or killed from outside\)",
        message,
    ), message
    assert not rank_decode_workers()


def test_decode_batch_fn_with_encode_batch_trains_as_decode_fn_with_encode_bit_for_bit(
    spark, store
):
    """A real tokenizer's encode_batch over each batch, with each row's generator from
    augments, trains the same weights as its encode row by row (bucketed batches, a
    validation split); the batches decoded by 2 worker processes, the rows in threads."""
    tokenizers = pytest.importorskip("tokenizers")
    rows = sentences()
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordPiece(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordPieceTrainer(
        vocab_size=60, special_tokens=["[PAD]", "[UNK]"], show_progress=False
    )
    tokenizer.train_from_iterator([text for text, _ in rows], trainer)
    assert tokenizer.get_vocab_size() <= 128  # BagOfTokens' embedding

    def dropped(ids: list[int], augment) -> torch.Tensor:  # a token in 5 left out in training
        ids = torch.tensor(ids, dtype=torch.int64)
        return ids if augment is None else ids[torch.from_numpy(augment.random(len(ids)) > 0.2)]

    def per_row(row, augment):
        return {"text": dropped(tokenizer.encode(row["text"]).ids, augment)}

    def per_batch(rows, augments):
        encodings = tokenizer.encode_batch(rows["text"])
        assert augments is None or len(augments) == len(encodings)
        augments = augments or [None] * len(encodings)
        return {"text": [dropped(e.ids, a) for e, a in zip(encodings, augments)]}

    df = spark.createDataFrame(rows, "text string, label long")
    params = dict(feature_cols=["text"], epochs=2, batch_size=16, validation=0.2)
    fits = [
        estimator(BagOfTokens(), store, 0.05, bucket_by_length=True, **params, **decode).fit(df)
        for decode in (
            {"decode_fn": per_row, "decode_pool": "threads"},
            {"decode_batch_fn": per_batch, "decode_pool": "processes", "decode_workers": 2},
        )
    ]
    assert [m.getTrainingSummary()["decoding"][0]["pool"] for m in fits] == [
        "threads",
        "processes",
    ]
    rowwise, batched = (m.getModel().state_dict() for m in fits)
    for name, value in rowwise.items():
        assert torch.equal(batched[name], value), name
    losses = [[(h["train"], h["validation"]) for h in m.getHistory()] for m in fits]
    assert losses[0] == losses[1]
    padding = [m.getTrainingSummary()["padding"] for m in fits]
    assert padding[0] == padding[1] and padding[0]["share"] > 0
