"""Security on a real local[4] Spark session: store credentials never leak (files in the store,
saved stages, messages, driver logs); state files load weights-only; a saved model keeps its
weights in a weights-only file. See docs/security.md."""

import base64
import gzip
import hashlib
import inspect
import logging
import pickle
import traceback
import uuid
import warnings
import zipfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from spark_estimator import Store, TorchEstimator, TorchModel
from spark_estimator.callbacks import Callback
from spark_estimator.driver.persistence import OBJECTS_FILE, WEIGHTS_FILE
from spark_estimator.shared.serialization import state_from_bytes, state_to_bytes
from tests.conftest import linear_net, make_estimator
from tests.faults import Fault


# -- the sentinel secrets and where to look for them ------------------------------------------
def new_secrets() -> list[str]:
    """Fresh values, made at run time: test code shipped to executors or saved by value never
    holds them as constants, so finding one anywhere means a Store's options leaked."""
    tag = uuid.uuid4().hex
    return [f"AKIA{tag[:16].upper()}", f"sentinel-secret-{tag}", f"sentinel-token-{tag[::-1]}"]


def credential_store(root: Path, secrets: list[str]) -> Store:
    """A local store whose fsspec filesystem really got the secrets as storage_options
    (LocalFileSystem keeps unknown keyword arguments, as s3fs keeps key/secret/token)."""
    key, secret, token = secrets
    options = {"key": key, "secret": secret, "client_kwargs": {"aws_session_token": token}}
    store = Store.create(str(root), storage_options=options)
    assert store.fs.storage_options == options
    return store


def encodings(secret: str) -> list[bytes]:
    """``secret`` as raw UTF-8 and as it reads inside base64 text at each of the 3 offsets."""
    raw = secret.encode()
    return [raw] + [base64.b64encode(b"\0" * i + raw)[4:-4] for i in range(3)]


def leaked(data: bytes | str, secrets: list[str]) -> list[str]:
    data = data.encode() if isinstance(data, str) else data
    return [s for s in secrets if any(form in data for form in encodings(s))]


def readable_parts(path: Path):
    """(name, bytes) for ``path`` and for whatever is inside it: zip members (torch .pt
    files), gzip content, Parquet rows and key-value metadata."""
    data = path.read_bytes()
    yield str(path), data
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            for member in zf.namelist():
                yield f"{path}:{member}", zf.read(member)
    if data[:2] == b"\x1f\x8b":
        yield f"{path}:gunzip", gzip.decompress(data)
    if path.suffix == ".parquet":
        table = pq.read_table(path)
        yield f"{path}:rows", repr(table.to_pylist()).encode()
        yield f"{path}:metadata", repr(table.schema.metadata).encode()


def assert_no_secret_in_files(folders: list[Path], secrets: list[str]) -> int:
    """Every byte of every file (hidden ones too) under ``folders``; returns the file count."""
    files = [p for folder in folders for p in sorted(folder.rglob("*")) if p.is_file()]
    found = [(name, leaked(data, secrets)) for p in files for name, data in readable_parts(p)]
    assert [f for f in found if f[1]] == []
    return len(files)


def debug_logs(caplog) -> None:
    """Every driver logger at DEBUG except py4j's wire trace, which logs each byte sent to
    the JVM: the task closure too, and the credentials it carries to the executors (base64,
    inside the pickle), as it logs all data; see docs/security.md."""
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.INFO, logger="py4j")


def assert_no_secret_in_error(error: BaseException, secrets: list[str]) -> str:
    """The message, the traceback and every chained cause."""
    text = "".join(traceback.format_exception(error))
    assert leaked(text, secrets) == []
    return text


# -- user objects that hold the store, so saving them could write it ---------------------------
class HoldsStore(Callback):
    """Fails the fit unless the credentials reached the executor, in memory."""

    def __init__(self, store: Store):
        self.store = store

    def on_train_begin(self, state):
        if not self.store.storage_options:
            raise RuntimeError("the executor's Store has no storage_options")


def transform_using(store: Store):
    def transform(batch):
        assert store.url  # the closure holds the Store
        return batch

    return transform


def exploding_loss(output, label):
    raise RuntimeError("this loss fails on the executor")


# -- the tests ---------------------------------------------------------------------------------
def test_credentials_reach_no_file_message_or_log(spark, tmp_path, regression_df, caplog):
    secrets = new_secrets()
    store = credential_store(tmp_path / "store", secrets)
    est = make_estimator(
        store=store,
        epochs=2,
        validation=0.25,
        run_id="secure-run",
        callbacks=[HoldsStore(store)],
        transformation_fn=transform_using(store),
    )
    assert est.getKeepCheckpoints() is None
    debug_logs(caplog)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = est.fit(regression_df)
        model.save(str(tmp_path / "model"))
        est.save(str(tmp_path / "estimator"))
        with pytest.raises(ValueError, match="run_id: run 'secure-run' already finished") as e:
            est.fit(regression_df)
        assert store.url in str(e.value)
        assert_no_secret_in_error(e.value, secrets)
        with pytest.raises(ValueError, match="does not exist") as e:
            est.fit_on_parquet("no/such/dataset", params={est.run_id: None})
        assert_no_secret_in_error(e.value, secrets)
    assert leaked(caplog.text, secrets) == []
    assert leaked("\n".join(str(w.message) for w in caught), secrets) == []

    # the store holds checkpoints of every epoch, the result, the ranks and the dataset
    run = store.run("secure-run")
    state_files = sorted(Path(run.path).rglob("*.pt"))
    assert [str(p) for p in state_files] == [run.checkpoint(1), run.checkpoint(2), run.result]
    assert Path(run.ranks).is_file()
    assert any(Path(store.dataset(d.name).meta).is_file() for d in Path(store.datasets).iterdir())
    assert (tmp_path / "model" / WEIGHTS_FILE).is_file()
    assert (tmp_path / "estimator" / OBJECTS_FILE).is_file()
    folders = [tmp_path / "store", tmp_path / "model", tmp_path / "estimator"]
    assert assert_no_secret_in_files(folders, secrets) > 20
    for path in [*state_files, tmp_path / "model" / WEIGHTS_FILE]:
        state_from_bytes(path.read_bytes())  # weights-only loadable

    assert repr(store) == str(store) == f"Store({store.url!r})"
    assert store.url in est.explainParams()
    for text in (repr(store), str(store), est.explainParams(), model.explainParams()):
        assert leaked(text, secrets) == []

    # what was saved comes back without credentials; the user sets them again
    back = TorchEstimator.load(str(tmp_path / "estimator"))
    assert back.getStore().url == store.url and back.getStore().storage_options == {}
    assert back.getCallbacks()[0].store.storage_options == {}
    loaded = TorchModel.load(str(tmp_path / "model"))
    assert torch.equal(loaded.getModel().weight, model.getModel().weight)


def test_a_failing_fit_reports_no_credentials(spark, tmp_path, regression_df, caplog):
    secrets = new_secrets()
    store = credential_store(tmp_path / "store", secrets)
    est = make_estimator(store=store, epochs=1, loss=exploding_loss, run_id="failing-run")
    debug_logs(caplog)
    with pytest.raises(Exception) as e:  # the executor failure's type is being changed
        est.fit(regression_df)
    text = assert_no_secret_in_error(e.value, secrets)
    assert "this loss fails on the executor" in text
    assert leaked(caplog.text, secrets) == []
    assert assert_no_secret_in_files([tmp_path / "store"], secrets) > 0


class RunsCode:
    """What a malicious state file could hold: unpickling it would call ``open``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def test_state_files_refuse_pickled_objects(tmp_path):
    canary = tmp_path / "canary"
    data = state_to_bytes({"model": {"w": torch.ones(2)}, "payload": RunsCode(str(canary))})
    assert not canary.exists()
    with pytest.raises(pickle.UnpicklingError, match="state: refused to load"):
        state_from_bytes(data)
    assert not canary.exists()


def test_saved_model_weights_load_weights_only(spark, tmp_path):
    """The model's pickle holds the architecture, weights.pt its tensors: a plain state dict
    anyone can read with weights_only=True, into their own copy of the architecture."""
    net = linear_net(3, 2, seed=3)
    TorchModel(model=net, feature_cols=["x"]).save(str(tmp_path / "model"))
    weights = torch.load(tmp_path / "model" / WEIGHTS_FILE, weights_only=True)
    assert set(weights) == {"weight", "bias"}
    own = linear_net(3, 2, seed=9)
    own.load_state_dict(weights)
    assert torch.equal(own.weight, net.weight)
    pickled = (tmp_path / "model" / OBJECTS_FILE).read_bytes()
    assert net.weight.detach().numpy().tobytes() not in pickled


def test_a_saved_model_with_a_store_inside_keeps_no_credentials(spark, tmp_path):
    secrets = new_secrets()
    net = linear_net()
    net.store = credential_store(tmp_path / "store", secrets)  # e.g. a notebook's global
    net.fs = net.store.fs
    TorchModel(model=net, feature_cols=["x"]).save(str(tmp_path / "model"))
    assert_no_secret_in_files([tmp_path / "model"], secrets)
    back = TorchModel.load(str(tmp_path / "model")).getModel()
    assert back.store.url == net.store.url and back.store.storage_options == {}
    assert back.fs.storage_options == {}


def test_source_read_options_stay_out_of_the_store(spark, tmp_path, regression_df):
    secrets = new_secrets()
    regression_df.write.parquet(str(tmp_path / "source"))
    df = spark.read.option("fs.s3a.secret.key", secrets[1]).parquet(str(tmp_path / "source"))
    store = Store.create(str(tmp_path / "store"))
    make_estimator(store=store).materialize(df)
    assert_no_secret_in_files([tmp_path / "store"], secrets)


class RecordsTheLaunchSecret(Callback):
    """Writes, from each rank of each launch, a digest of the rendezvous secret its task got
    (the ``spec`` of the ``training_task`` that runs it) to a file of its own in ``folder``."""

    def __init__(self, folder: str):
        self.folder = folder

    def on_train_begin(self, state):
        frame = inspect.currentframe()
        while frame.f_code.co_name != "training_task":
            frame = frame.f_back
        secret = frame.f_locals["spec"].secret
        digest = hashlib.sha256(secret.encode()).hexdigest()
        with open(f"{self.folder}/{uuid.uuid4().hex}", "w") as f:
            f.write(f"{state.rank} {digest}")


def test_each_launch_of_a_fit_has_a_rendezvous_secret_of_its_own(spark, tmp_path, regression_df):
    """A fit started again after a lost process (here an I/O error, which is retried) gives
    the new barrier job a fresh secret: nothing sealed in one launch's store passes in the
    next. The ranks of one launch share theirs."""
    seen = tmp_path / "secrets"
    seen.mkdir()
    fault = Fault("io-error", rank=1, epoch=1, marker=tmp_path / "io", after_batches=1)
    est = make_estimator(
        store=Store.create(str(tmp_path / "store")),
        epochs=1,
        num_proc=2,
        callbacks=[RecordsTheLaunchSecret(str(seen)), fault],
    )
    model = est.fit(regression_df)
    assert (tmp_path / "io").exists() and model.getHistory()
    records = [p.read_text().split() for p in seen.iterdir()]
    assert sorted(rank for rank, _ in records) == ["0", "0", "1", "1"]  # two launches of 2
    assert len({digest for _, digest in records}) == 2
