"""Where datasets, runs, checkpoints and results live: a folder on any fsspec filesystem.

Layout under the store's root (see docs/store.md)::

    datasets/<key>/<write-id>/train/*.parquet   materialized training rows (one write's)
    datasets/<key>/<write-id>/validation/*.parquet   materialized validation rows
    datasets/<key>/_meta.json                   written last: names the complete write,
                                                row counts, files, columns, row lengths
    runs/<run_id>/run.json                      what the checkpoints were made with
    runs/<run_id>/checkpoints/epoch-0001.pt     rank 0's checkpoint after each epoch
    runs/<run_id>/failures/<launch>.json        the training code's error, when it raised
    runs/<run_id>/result.pt                     final weights, history, output shapes
    runs/<run_id>/ranks.json                    one summary per rank (rows, weights digest)

A Store is used on the driver and, pickled, on every executor. Every file is written to a
temporary name and moved into place, so a crash never leaves a half-written file behind.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import uuid
from typing import Any

import fsspec

_CHECKPOINT = re.compile(r"epoch-(\d+)\.pt")


class Store:
    """A root folder, local or remote, addressed by a path or an fsspec URL.

    ``storage_options`` go to fsspec (credentials, endpoints). They are kept in memory
    only: they are never written into saved metadata.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        if not isinstance(url, str) or not url:
            raise ValueError("store: url must be a non-empty string")
        protocol, path = fsspec.core.split_protocol(url)
        protocol = protocol or "file"
        if protocol in ("file", "local"):
            protocol = "file"
            path = os.path.abspath(os.path.expanduser(path))
        self.protocol = protocol
        self.root = path.rstrip("/") or "/"
        self.storage_options = dict(storage_options or {})
        self._fs = None

    @classmethod
    def create(cls, url: str, storage_options: dict[str, Any] | None = None) -> Store:
        """Open (creating if needed) a store rooted at ``url``."""
        store = cls(url, storage_options)
        store.fs.makedirs(store.root, exist_ok=True)
        return store

    @property
    def url(self) -> str:
        """The root as a URL, without any credentials."""
        return self.root if self.protocol == "file" else f"{self.protocol}://{self.root}"

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        if self._fs is None:
            self._fs = fsspec.filesystem(self.protocol, **self.storage_options)
        return self._fs

    def __getstate__(self):
        return {"url": self.url, "storage_options": self.storage_options}

    def __setstate__(self, state):
        self.__init__(state["url"], state["storage_options"])

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    # -- paths ---------------------------------------------------------------------------
    def join(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def dataset_path(self, key: str) -> str:
        return self.join("datasets", key)

    def run_path(self, run_id: str) -> str:
        return self.join("runs", run_id)

    def checkpoint_path(self, run_id: str, epoch: int) -> str:
        return self.join("runs", run_id, "checkpoints", f"epoch-{epoch:04d}.pt")

    def checkpoint_epochs(self, run_id: str) -> list[int]:
        """Epochs of ``run_id`` with a checkpoint, ascending."""
        folder = posixpath.dirname(self.checkpoint_path(run_id, 1))
        if not self.exists(folder):
            return []
        names = (posixpath.basename(p) for p in self.fs.ls(folder, detail=False))
        return sorted(int(m.group(1)) for n in names if (m := _CHECKPOINT.fullmatch(n)))

    def result_path(self, run_id: str) -> str:
        return self.join("runs", run_id, "result.pt")

    def spark_url(self, path: str) -> str:
        """``path`` in the form Spark's Hadoop filesystems expect."""
        if self.protocol == "file":
            return "file://" + path
        if self.protocol == "s3":
            return "s3a://" + path
        return f"{self.protocol}://{path}"

    # -- files ---------------------------------------------------------------------------
    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def read_bytes(self, path: str) -> bytes:
        with self.fs.open(path, "rb") as f:
            return f.read()

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` atomically: a temporary sibling, then a move."""
        parent = posixpath.dirname(path)
        self.fs.makedirs(parent, exist_ok=True)
        tmp = posixpath.join(parent, f".tmp-{uuid.uuid4().hex}-{posixpath.basename(path)}")
        try:
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
            self.fs.mv(tmp, path)
        except BaseException:
            self.remove(tmp)
            raise

    def read_json(self, path: str) -> Any:
        return json.loads(self.read_bytes(path))

    def write_json(self, path: str, value: Any) -> None:
        self.write_bytes(path, json.dumps(value, indent=1, sort_keys=True).encode())

    def move(self, src: str, dst: str) -> None:
        self.fs.mv(src, dst, recursive=True)

    def remove(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)
