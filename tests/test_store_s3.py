"""A store on S3, against a real S3-compatible server (moto's server mode, on localhost):
materialization, a fit's run files and result, and a TorchModel's save/load all go through
S3 (s3fs) with the store's storage_options and nothing else; no credential is ever written.
Spark's executors reach the server as any S3 client would: over HTTP."""

import gzip
import io
import json
import logging
import posixpath
import uuid
import zipfile

import fsspec
import pyarrow.parquet as pq
import pytest
import torch

from spark_estimator import Store, TorchModel
from spark_estimator.callbacks import Callback
from spark_estimator.driver.materialize import WriteOptions, materialize
from spark_estimator.driver.validate import check_columns
from spark_estimator.store import DatasetFolder
from tests.conftest import make_estimator

# a real local S3 server (test tools of the default stack only)
ThreadedMotoServer = pytest.importorskip("moto.server").ThreadedMotoServer


@pytest.fixture(scope="module")
def s3_endpoint():
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request
    # port 0: the server binds a port of its own choosing (one picked here and bound later
    # could be taken by another process meanwhile)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3(s3_endpoint):
    """(bucket, storage_options): a fresh bucket and credentials made at run time."""
    tag = uuid.uuid4().hex
    options = {"endpoint_url": s3_endpoint, "key": f"AKIA{tag[:16]}", "secret": f"s3cret-{tag}"}
    bucket = f"bucket-{tag[:12]}"
    fsspec.filesystem("s3", **options).mkdir(bucket)
    return bucket, options


def s3_view(options) -> fsspec.AbstractFileSystem:
    """An S3 client of the test's own, with no listings cache: what the bucket really holds."""
    return fsspec.filesystem("s3", use_listings_cache=False, skip_instance_cache=True, **options)


def readable(data: bytes) -> list[bytes]:
    """``data`` and what is inside it: zip members (torch files), gzip, Parquet metadata."""
    parts = [data]
    if zipfile.is_zipfile(io.BytesIO(data)):
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            parts += [zf.read(name) for name in zf.namelist()]
    if data[:2] == b"\x1f\x8b":
        parts.append(gzip.decompress(data))
    if data[:4] == b"PAR1":
        parts.append(repr(pq.ParquetFile(io.BytesIO(data)).schema_arrow.metadata).encode())
    return parts


def assert_no_credentials(fs, bucket: str, options: dict) -> int:
    secrets = [options["key"].encode(), options["secret"].encode()]
    paths = fs.find(bucket)
    found = [p for p in paths for part in readable(fs.cat_file(p)) for s in secrets if s in part]
    assert found == []
    return len(paths)


class PrintsEpochs(Callback):
    def on_epoch_end(self, epoch, logs, state):
        print(f"s3 test epoch {epoch} done", flush=True)


def with_options(writer_or_reader, options: dict):
    for name, value in options.items():
        writer_or_reader.option(name, value)
    return writer_or_reader


def test_materialize_writes_to_s3_what_it_writes_locally(spark, s3, regression_df, store):
    bucket, options = s3
    s3_store = Store.create(f"s3://{bucket}/root", storage_options=options)
    features, labels = check_columns(regression_df.schema, ["x"], ["y"])
    write = WriteOptions(num_files=3, row_group_bytes=256, compression="zstd")
    data = materialize(regression_df, s3_store, features, labels, 0.25, 0, write)
    local = materialize(regression_df, store, features, labels, 0.25, 0, write)
    fs = s3_view(options)
    assert s3_store.root == f"{bucket}/root"
    assert data.path == s3_store.dataset(data.source["key"]).path
    meta = json.loads(fs.cat_file(DatasetFolder(data.path).meta))
    assert meta["write_id"] == data.write_id and meta["rows"] == local.to_json()["rows"]
    listed = [p for split in data.files.values() for p, _ in split]
    on_s3 = sorted(posixpath.relpath(p, data.path) for p in fs.find(data.path))
    meta_name = posixpath.relpath(DatasetFolder(data.path).meta, data.path)
    assert on_s3 == sorted([meta_name, *listed])  # no temporary or marker files
    for split in ("train", "validation"):
        assert len(data.files[split]) == len(local.files[split]) <= 3
        for (rel, groups), (local_rel, local_groups) in zip(data.files[split], local.files[split]):
            assert posixpath.basename(rel) == posixpath.basename(local_rel)
            assert groups == local_groups
            with fs.open(posixpath.join(data.path, rel), "rb") as f:
                parquet = pq.ParquetFile(f)
                assert parquet.metadata.num_row_groups == len(groups)
                table = parquet.read()
            assert table.equals(pq.read_table(posixpath.join(local.path, local_rel)))
    assert max(len(groups) for split in data.files.values() for _, groups in split) > 1
    again = materialize(regression_df, s3_store, features, labels, 0.25, 0, write)
    assert again.reused and again.write_id == data.write_id


def test_a_fit_on_an_s3_store_and_the_models_save_and_load(spark, s3, regression_df, monkeypatch):
    bucket, options = s3
    store = Store.create(f"s3://{bucket}/root", storage_options=options)
    est = make_estimator(
        store=store, epochs=2, validation=0.25, run_id="s3-run", callbacks=[PrintsEpochs()]
    )
    model = est.fit(regression_df)
    assert len(model.getHistory()) == 2
    fs = s3_view(options)
    run = store.run("s3-run")
    assert store.root == f"{bucket}/root"
    expected = {run.manifest, run.result, run.ranks, run.checkpoint(1), run.checkpoint(2)}
    assert expected <= set(fs.find(run.path))
    logs = fs.find(run.logs)
    assert any(b"s3 test epoch 2 done" in fs.cat_file(p) for p in logs)
    checkpoint = torch.load(io.BytesIO(fs.cat_file(run.checkpoint(2))), weights_only=True)
    assert torch.equal(checkpoint["model"]["weight"], model.getModel().weight)
    assert len(fs.find(store.datasets)) >= 3  # _meta.json and Parquet files

    path = f"s3://{bucket}/models/regression"
    with_options(model.write(), options).save(path)
    assert fs.exists(f"{bucket}/models/regression/metadata/_SUCCESS")
    with pytest.raises(FileExistsError, match="already exists"):
        with_options(model.write(), options).save(path)
    model.getModel().weight.data += 1.0  # load below sees the new weights
    with_options(model.write().overwrite(), options).save(path)  # staged beside, then moved
    saved = {posixpath.relpath(p, f"{bucket}/models") for p in fs.find(f"{bucket}/models")}
    stage = ["metadata/_SUCCESS", "metadata/part-00000", "objects.pkl", "weights.pt"]
    assert saved == {f"regression/{name}" for name in stage}  # nothing left beside it
    loaded = with_options(TorchModel.read(), options).load(path)
    assert loaded.getHistory() == model.getHistory()
    # no options: fsspec's configuration (what FSSPEC_S3_* environment variables set)
    monkeypatch.setitem(fsspec.config.conf, "s3", dict(options))
    by_config = TorchModel.load(path)
    assert torch.equal(by_config.getModel().weight, model.getModel().weight)

    def predictions(m):
        return [r.prediction for r in m.transform(regression_df).orderBy("id").collect()]

    assert predictions(by_config) == pytest.approx(predictions(model))
    assert assert_no_credentials(fs, bucket, options) > 10
    assert options["secret"] not in repr(store) and options["key"] not in store.url


def test_a_store_lists_what_other_processes_wrote_after_it_listed(s3):
    bucket, options = s3
    store = Store.create(f"s3://{bucket}/root", storage_options=options)
    store.write_bytes(store.run("r").checkpoint(1), b"x")
    assert store.checkpoint_epochs("r") == [1]  # listed once
    s3_view(options).pipe_file(store.run("r").checkpoint(2), b"y")  # another client
    assert store.checkpoint_epochs("r") == [1, 2]
    assert store.exists(store.run("r").checkpoint(2))
