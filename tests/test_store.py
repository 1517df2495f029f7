import pickle
from pathlib import Path

import pytest

import spark_estimator.store as store_module
from spark_estimator import Store
from spark_estimator.store import hidden_sibling, layout

ROOT = Path(__file__).resolve().parents[1]


def test_create_makes_root_and_resolves_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = Store.create("rel/store")
    assert store.protocol == "file"
    assert store.root == str(tmp_path / "rel" / "store")
    assert (tmp_path / "rel" / "store").is_dir()
    assert Store("file://" + str(tmp_path)).root == str(tmp_path)


def test_layout_paths(store):
    assert store.dataset("k").path == store.datasets + "/k"
    assert store.dataset("k").meta.endswith("/datasets/k/_meta.json")
    assert store.dataset("k").part("w", "train", 3).endswith("/k/w/train/part-00003.parquet")
    run = store.run("r1")
    assert run.path == store.runs + "/r1" and store.runs == store.root + "/runs"
    assert run.checkpoint(3).endswith("/runs/r1/checkpoints/epoch-0003.pt")
    assert run.result.endswith("/runs/r1/result.pt")
    assert run.failure("L").endswith("/runs/r1/failures/L.json")
    assert run.rank_logs(2).endswith("/runs/r1/logs/rank-2")
    assert run.log_rank(run.rank_logs(2) + "/L-0-1.log") == 2
    assert run.log_rank(run.logs + "/other/L-0-1.log") is None
    assert pickle.loads(pickle.dumps(run)) == run


def test_checkpoint_epochs_lists_only_checkpoints(store):
    run = store.run("r1")
    assert store.checkpoint_epochs("r1") == []
    for epoch in (10, 2):
        store.write_bytes(run.checkpoint(epoch), b"x")
    store.write_bytes(hidden_sibling(run.checkpoint(3)), b"a killed writer's")
    assert store.checkpoint_epochs("r1") == [2, 10]


def _listed_paths(block: str) -> list[str]:
    """The paths of a layout listing: the first word of each line that is not indented
    more than the listing (those continue a description)."""
    lines = [line for line in block.splitlines() if line.strip()]
    indent = min(len(line) - len(line.lstrip()) for line in lines)
    return [line.split()[0] for line in lines if not line[indent].isspace()]


def test_the_docs_list_the_layout_the_code_makes():
    listing = layout()
    assert len(listing) == len(set(listing)) and "runs/<run_id>/run.json" in listing
    docstring = store_module.__doc__.split("::\n\n")[1].split("\n\n")[0]
    assert _listed_paths(docstring) == listing
    page = (ROOT / "docs/store.md").read_text()
    block = page.split("<!-- layout: spark_estimator.store.layout() -->\n```\n")[1]
    assert _listed_paths(block.split("```")[0]) == listing


def test_write_bytes_is_atomic_and_leaves_no_temp_files(store):
    path = store.join("a", "b.bin")
    store.write_bytes(path, b"one")
    store.write_bytes(path, b"two")
    assert store.read_bytes(path) == b"two"
    assert [p.rsplit("/", 1)[-1] for p in store.fs.ls(store.join("a"))] == ["b.bin"]


def test_a_write_that_fails_halfway_leaves_the_old_file(store, monkeypatch):
    path = store.join("a", "b.bin")
    store.write_bytes(path, b"old")
    real_open = store.fs.open

    class Crashing:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[:2])
            raise OSError("disk full")

    monkeypatch.setattr(store.fs, "open", lambda p, mode="rb": Crashing(real_open(p, mode)))
    with pytest.raises(OSError, match="disk full"):
        store.write_bytes(path, b"new content")
    monkeypatch.undo()
    assert store.read_bytes(path) == b"old"
    assert [p.rsplit("/", 1)[-1] for p in store.fs.ls(store.join("a"))] == ["b.bin"]


def test_json_round_trip_and_remove(store):
    path = store.join("x", "meta.json")
    store.write_json(path, {"rows": 3})
    assert store.read_json(path) == {"rows": 3}
    store.remove(store.join("x"))
    assert not store.exists(path)


def test_pickle_keeps_url_and_options_but_url_has_no_credentials(tmp_path):
    store = Store(str(tmp_path), storage_options={"auto_mkdir": True})
    clone = pickle.loads(pickle.dumps(store))
    assert clone.url == store.url and clone.storage_options == {"auto_mkdir": True}
    assert "auto_mkdir" not in repr(store)


@pytest.mark.parametrize("bad", ["", None])
def test_rejects_empty_url(bad):
    with pytest.raises(ValueError, match="store"):
        Store(bad)


def test_open_atomic_shows_the_file_only_when_complete(store):
    path = store.join("d", "f.bin")
    store.write_bytes(path, b"old")
    with store.open_atomic(path) as f:
        f.write(b"new, in parts")
        f.flush()
        assert store.read_bytes(path) == b"old"
        [temporary] = [p for p in store.fs.ls(store.join("d"), detail=False) if p != path]
        assert temporary.rsplit("/", 1)[-1].startswith(".tmp-")
    assert store.read_bytes(path) == b"new, in parts"
    with pytest.raises(RuntimeError, match="stopped"):
        with store.open_atomic(path) as f:
            f.write(b"never complete")
            raise RuntimeError("stopped")
    assert store.read_bytes(path) == b"new, in parts"
    assert store.fs.ls(store.join("d"), detail=False) == [path]


def test_url_options_such_as_an_hdfs_namenode_go_to_the_filesystem_not_the_path():
    store = Store("hdfs://namenode:8020/user/me/store/", storage_options={"user": "me"})
    assert store.protocol == "hdfs" and store.root == "/user/me/store"
    assert store.runs == "/user/me/store/runs"
    assert store.url == "hdfs://namenode:8020/user/me/store"
    assert store._url_options == {"host": "namenode", "port": 8020}  # the fs is never opened
    clone = pickle.loads(pickle.dumps(store))
    assert (clone.url, clone.root, clone._url_options) == (
        store.url,
        store.root,
        {
            "host": "namenode",
            "port": 8020,
        },
    )
    s3 = Store("s3://bucket/root/")
    assert (s3.root, s3.url) == ("bucket/root", "s3://bucket/root")


def test_a_remote_store_opens_its_filesystem_without_a_listings_cache():
    store = Store("memory://no-cache/root", storage_options={"skip_instance_cache": True})
    assert store.fs.dircache.use_listings_cache is False
    local = Store("/tmp")
    assert local.fs.storage_options == {}


def test_one_slash_urls_are_placed_as_spark_places_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = Store.create("file:" + str(tmp_path / "local"))
    assert (local.protocol, local.root, local.url) == ("file", str(tmp_path / "local"), local.root)
    assert (tmp_path / "local").is_dir()
    dbfs = Store("dbfs:/tmp/spark-estimator/")  # Databricks' FUSE mounts of DBFS and volumes
    assert (dbfs.protocol, dbfs.root) == ("file", "/dbfs/tmp/spark-estimator")
    assert Store("dbfs:/Volumes/cat/schema/vol/se").root == "/Volumes/cat/schema/vol/se"
    hdfs = Store("hdfs:/user/me/store")  # the namenode of fs.defaultFS, as hdfs:///
    assert (hdfs.protocol, hdfs.root) == ("hdfs", "/user/me/store")
    assert hdfs.url == "hdfs:///user/me/store"
    assert hdfs._url_options == {}
    assert pickle.loads(pickle.dumps(hdfs)).root == "/user/me/store"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local"]  # no folder named 'file:'


@pytest.mark.parametrize(
    "url", ["s3a:/bucket/store", "s3:/bucket/store", "gs:/bucket/x", "abfss:/x", "dbfs:tmp/x"]
)
def test_a_url_the_store_cannot_place_is_refused_naming_it(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"store: cannot place '{url}'"):
        Store.create(url)
    assert list(tmp_path.iterdir()) == []  # no relative folder made of the URL
