"""Where datasets, runs, checkpoints and results live: a folder on any fsspec filesystem.

Layout under the store's root (see docs/store.md); every path is named by ``Store.dataset``
(a ``DatasetFolder``) or ``Store.run`` (a ``RunFolder``), and ``layout()`` lists them::

    datasets/<key>/<write-id>/train/part-00000.parquet       materialized training rows
    datasets/<key>/<write-id>/validation/part-00000.parquet  materialized validation rows
    datasets/<key>/_meta.json                                written last: names the complete write;
                                                             its files, rows, row lengths
    datasets/_index/rows-<digest>.json                       the first dataset written of these
                                                             rows (its key): equal rows reuse it
    datasets/_index/key-<key>.json                           a key whose write was dropped for an
                                                             equal dataset: that dataset's key
    tables/<key>.json                                        a table trained on in place: its
                                                             files, row groups, splits, checks
    runs/<run_id>/run.json                                   what the checkpoints were made with
    runs/<run_id>/checkpoints/epoch-0001.pt                  rank 0's checkpoint after each epoch
    runs/<run_id>/shards/<name>/                             parallelism="fsdp": every rank's shard
                                                             of an epoch's checkpoint or a commit
    runs/<run_id>/commit.pt                                  the last commit inside an epoch
    runs/<run_id>/failures/<launch>.json                     the training code's error, if raised
    runs/<run_id>/result.pt                                  final weights, history, output shapes
    runs/<run_id>/ranks.json                                 one summary per rank (rows, digest)
    runs/<run_id>/progress.json                              rank 0's progress, for the driver's bar
    runs/<run_id>/logs/rank-<r>/                             each rank's output, in chunks
    runs/<run_id>/tensorboard/                               rank 0's TensorBoard event file
    runs/<run_id>/lightning/                                 a LightningEstimator's default_root_dir
    runs/<run_id>/processes/rank-<r>.json                    run(): rank r's host, pid, attempt
    runs/<run_id>/elastic/launches/<launch>                  run(): the launch entered hvd.elastic
    runs/<run_id>/elastic/commit.pt                          run(): the last hvd.elastic commit
    runs/<run_id>/elastic/grow.json                          a fit, an hvd.elastic run(): the ranks
                                                             stop so the job can grow
    runs/<run_id>/rendezvous/<launch>/<stage>.json           rank 0's TCPStore host and port
                                                             while the job's group forms
    runs/<run_id>/trial/epoch-0001.json                      a tuning trial: rank 0's value of
                                                             the epoch, for the tuner
    runs/<run_id>/trial/answer-0001.json                     the tuner's answer: prune or go on
    runs/<run_id>/model/                                     a tuning trial's fitted model, saved
                                                             when it was the study's best
    studies/<study>.journal                                  an Optuna study's journal (tuning)

A Store is used on the driver and, pickled with its ``storage_options``, on every executor.
Every file is written to a hidden temporary name (``.tmp-<id>-<name>``) and moved into
place, so no reader ever sees a half-written file under its real name. A writer killed
mid-write leaves its temporary file behind and nothing removes it. The package never reads
one (it reads only the names above; Parquet readers skip hidden names), but TensorBoard
reads any name with "tfevents" in it, so one left in ``tensorboard/`` shows up there until
deleted. Remote filesystems are opened without fsspec's listings cache: the store is
written by other processes, and a cached listing would hide their files.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

import fsspec

_CHECKPOINT = re.compile(r"epoch-(\d+)\.pt")  # RunFolder.checkpoint's names
_RANK_LOGS = re.compile(r"rank-(\d+)")  # RunFolder.rank_logs's names
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):(.*)", re.DOTALL)  # Spark's 'scheme:/path'
LOG_SUFFIX = {"stdout": ".log", "stderr": ".err.log"}  # a rank's output chunk, by its stream
TEMPORARY_PREFIX = ".tmp-"  # a file being written; moved to its real name when complete


def hidden_sibling(path: str, prefix: str = TEMPORARY_PREFIX) -> str:
    """A fresh hidden name beside ``path``: ``<prefix><id>-<name>``."""
    parent, name = posixpath.split(path.rstrip("/"))
    return posixpath.join(parent, f"{prefix}{uuid.uuid4().hex}-{name}")


def spark_url(url: str, param: str = "store") -> str:
    """``url`` (the store's root, or a ``save``/``load`` path) as fsspec reads it. fsspec
    knows only ``scheme://``; Spark and Databricks also write ``scheme:/path``, which fsspec
    would take for a relative local folder. Those are placed as Spark places them:
    ``file:/x`` is the local ``/x``, ``dbfs:/x`` the Databricks mount ``/dbfs/x``
    (``dbfs:/Volumes/...`` is ``/Volumes/...``), ``hdfs:/x`` is ``hdfs:///x`` (the namenode
    of ``fs.defaultFS``). Any other scheme with one slash (an object store without its
    bucket, ``s3a:/x``) or a relative path after a scheme is refused, naming ``param`` and
    the URL."""
    match = _SCHEME.fullmatch(url)
    if match is None or "://" in url:
        return url
    scheme, path = match.group(1).lower(), match.group(2)
    if path.startswith("/"):
        if scheme in ("file", "local"):
            return path
        if scheme == "dbfs":
            volume = path == "/Volumes" or path.startswith("/Volumes/")
            return path if volume else "/dbfs" + path
        if scheme == "hdfs":
            return "hdfs://" + path
    raise ValueError(
        f"{param}: cannot place {url!r}: after '{scheme}:' comes no '//host' or bucket (only "
        "file:/, dbfs:/ and hdfs:/ paths are understood without one); write "
        f"'{scheme}://<host or bucket>/path', or a local path"
    )


def _child(name: str, doc: str) -> property:
    """A property of a ``DatasetFolder`` or ``RunFolder``: ``name`` inside its ``path``."""
    return property(lambda folder: posixpath.join(folder.path, name), doc=doc)


@dataclass(frozen=True)
class DatasetFolder:
    """The paths of one materialized dataset, ``datasets/<key>/``, or of a folder given as
    one (``path``)."""

    path: str
    meta = _child("_meta.json", "written last: names the complete write")

    def write(self, write_id: str) -> str:
        """The folder of one write of the dataset."""
        return posixpath.join(self.path, write_id)

    def part(self, write_id: str, split: str, partition: int) -> str:
        """The Parquet file of one Spark partition's rows of ``split`` in a write."""
        return posixpath.join(self.write(write_id), split, f"part-{partition:05d}.parquet")


@dataclass(frozen=True)
class RunFolder:
    """The paths of one run, ``runs/<run_id>/``."""

    path: str
    manifest = _child("run.json", "what the run's checkpoints were made with")
    checkpoints = _child("checkpoints", "rank 0's checkpoint after each epoch")
    step_commit = _child("commit.pt", "the last commit inside an epoch (commit_every_steps)")
    failures = _child("failures", "the training code's error, when a rank raised one")
    result = _child("result.pt", "final weights, history, output shapes")
    ranks = _child("ranks.json", "one summary per rank")
    progress = _child("progress.json", "rank 0's progress, for the driver's bar")
    logs = _child("logs", "one folder of output chunks per rank")
    tensorboard = _child("tensorboard", "rank 0's TensorBoard event file")
    lightning = _child("lightning", "a LightningEstimator's default_root_dir")
    processes = _child("processes", "run(): where each rank runs, written at its start")
    elastic = _child("elastic", "run(): hvd.elastic's launches and last commit")
    commit = _child("elastic/commit.pt", "run(): the last hvd.elastic commit (rank 0's)")
    grow = _child(
        "elastic/grow.json", "a fit, an hvd.elastic run: the ranks stop so the job can grow"
    )
    rendezvous = _child("rendezvous", "rank 0's TCPStore address while a job's group forms")
    trial = _child("trial", "a tuning trial: rank 0's epoch values and the tuner's answers")
    tuned_model = _child("model", "a tuning trial's fitted model, when it was the best")

    def trial_report(self, epoch: int) -> str:
        """Rank 0's value of ``epoch`` for the tuner (``shared.pruning``)."""
        return posixpath.join(self.trial, f"epoch-{epoch:04d}.json")

    def trial_answer(self, epoch: int) -> str:
        """The tuner's answer to ``trial_report(epoch)``: prune the trial or go on."""
        return posixpath.join(self.trial, f"answer-{epoch:04d}.json")

    def meeting(self, launch_id: str, stage: int | str) -> str:
        """Rank 0's TCPStore address for barrier job (Spark stage) ``stage`` of a launch
        (``meeting.Meeting``)."""
        return posixpath.join(self.rendezvous, launch_id, f"{stage}.json")

    def process(self, rank: int | str) -> str:
        """Rank ``rank``'s record: host, pid, launch and task attempt of its process."""
        return posixpath.join(self.processes, f"rank-{rank}.json")

    def elastic_launch(self, launch_id: str) -> str:
        """Written when launch ``launch_id`` of the run entered ``hvd.elastic.run``."""
        return posixpath.join(self.elastic, "launches", launch_id)

    def checkpoint(self, epoch: int) -> str:
        return posixpath.join(self.checkpoints, f"epoch-{epoch:04d}.pt")

    def shards(self, name: str) -> str:
        """``parallelism="fsdp"``: the folder of every rank's shard of the model and
        optimizer (``torch.distributed.checkpoint``) that the checkpoint or commit naming
        ``name`` holds (``epoch-0001``, ``commit-<id>``)."""
        return posixpath.join(self.path, "shards", name)

    def failure(self, launch_id: str) -> str:
        return posixpath.join(self.failures, f"{launch_id}.json")

    def rank_logs(self, rank: int | str) -> str:
        """The folder of rank ``rank``'s output chunks."""
        return posixpath.join(self.logs, f"rank-{rank}")

    def log_stream(self, path: str) -> str:
        """The stream ("stdout" or "stderr") an output chunk ``path`` holds."""
        return "stderr" if path.endswith(LOG_SUFFIX["stderr"]) else "stdout"

    def log_rank(self, path: str) -> int | None:
        """The rank whose log folder holds the file ``path``, or None."""
        match = _RANK_LOGS.fullmatch(posixpath.basename(posixpath.dirname(path)))
        return int(match.group(1)) if match else None


def layout() -> list[str]:
    """Every kind of path in a store, relative to its root, with placeholders (folders end
    with ``/``): what this module's docstring and docs/store.md list (the store's tests
    hold them to it)."""
    store = Store("/")  # only its paths are used: the filesystem is never opened
    data, run = store.dataset("<key>"), store.run("<run_id>")
    paths = [
        data.part("<write-id>", "train", 0),
        data.part("<write-id>", "validation", 0),
        data.meta,
        store.rows_index("<digest>"),
        store.key_alias("<key>"),
        store.table("<key>"),
        run.manifest,
        run.checkpoint(1),
        run.shards("<name>") + "/",
        run.step_commit,
        run.failure("<launch>"),
        run.result,
        run.ranks,
        run.progress,
        run.rank_logs("<r>") + "/",
        run.tensorboard + "/",
        run.lightning + "/",
        run.process("<r>"),
        run.elastic_launch("<launch>"),
        run.commit,
        run.grow,
        run.meeting("<launch>", "<stage>"),
        run.trial_report(1),
        run.trial_answer(1),
        run.tuned_model + "/",
        store.study_journal("<study>"),
    ]
    return [p.removeprefix("/") for p in paths]


class Store:
    """A root folder, local or remote, addressed by a path or an fsspec URL.

    ``storage_options`` go to fsspec (credentials, endpoints). They are kept in memory
    only: they are never written into saved metadata.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        if not isinstance(url, str) or not url:
            raise ValueError("store: url must be a non-empty string")
        url = spark_url(url)
        protocol, path = fsspec.core.split_protocol(url)
        protocol = protocol or "file"
        self._url_options: dict[str, Any] = {}  # what the URL says besides the path
        if protocol in ("file", "local"):
            protocol = "file"
            path = os.path.abspath(os.path.expanduser(path))
        else:
            try:
                fs_class = fsspec.get_filesystem_class(protocol)
            except (ImportError, ValueError):  # not installed or unknown: fails when used
                pass
            else:  # e.g. hdfs://namenode:8020/path: host and port are options, not the path
                path = fs_class._strip_protocol(url)
                self._url_options = fs_class._get_kwargs_from_urls(url)
        self.protocol = protocol
        self.root = path.rstrip("/") or "/"
        trimmed = url if self.root == "/" else url.rstrip("/")
        self._url = self.root if protocol == "file" else trimmed
        self.storage_options = dict(storage_options or {})
        self._fs = None

    @classmethod
    def create(cls, url: str, storage_options: dict[str, Any] | None = None) -> Store:
        """Open a store rooted at ``url``, creating its folder where it does not exist.

        Parameters
        ----------
        url : str
            A local path, ``file://``, ``s3://``, ``hdfs://``, ``/dbfs`` or any fsspec URL.
            The driver and every executor must reach it (a local path only on one machine).
        storage_options : dict, optional
            fsspec's options for the filesystem (credentials, endpoint): kept in memory and
            shipped to the executors, never written to the store or a saved estimator.

        Returns
        -------
        Store
            The store: materialized datasets under ``datasets/``, runs (checkpoints,
            results, logs) under ``runs/``.

        Raises
        ------
        ValueError
            A URL fsspec does not know, or a filesystem whose package is not installed.

        Examples
        --------
        >>> store = Store.create("/tmp/spark-estimator")                        # doctest: +SKIP
        >>> store = Store.create("s3://bucket/prefix", {"key": "...", "secret": "..."})
        ...                                                                     # doctest: +SKIP
        """
        store = cls(url, storage_options)
        store.fs.makedirs(store.root, exist_ok=True)
        return store

    @property
    def url(self) -> str:
        """The root as a URL, without any credentials (as given, or the absolute local path)."""
        return self._url

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        if self._fs is None:
            self._fs = fsspec.filesystem(self.protocol, **self._options())
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

    def fsspec_target(self, path: str) -> tuple[str, dict[str, Any]]:
        """``path`` of this store as a URL and the options fsspec opens it with, for
        readers and writers that open the filesystem themselves."""
        url = path if self.protocol == "file" else self.fs.unstrip_protocol(path)
        return url, self._options()

    def _options(self) -> dict[str, Any]:
        uncached = {} if self.protocol == "file" else {"use_listings_cache": False}
        return {**uncached, **self._url_options, **self.storage_options}

    @property
    def datasets(self) -> str:
        """The folder of every materialized dataset."""
        return self.join("datasets")

    def dataset(self, key: str) -> DatasetFolder:
        return DatasetFolder(posixpath.join(self.datasets, key))

    def rows_index(self, digest: str) -> str:
        """The key of the first dataset written of the rows whose content digest (with the
        columns, split and write options) is ``digest``: ``datasets/_index/rows-<digest>.json``
        (see ``materialize``)."""
        return posixpath.join(self.datasets, "_index", f"rows-{digest}.json")

    def key_alias(self, key: str) -> str:
        """The key of the dataset that holds the rows of dataset key ``key``, whose own write
        was dropped for it: ``datasets/_index/key-<key>.json``."""
        return posixpath.join(self.datasets, "_index", f"key-{key}.json")

    def table(self, key: str) -> str:
        """What fits learned of a table they read in place (its files, row groups, the
        rows of each split, the value checks): ``tables/<key>.json``."""
        return self.join("tables", f"{key}.json")

    @property
    def runs(self) -> str:
        """The folder of every run."""
        return self.join("runs")

    def run(self, run_id: str) -> RunFolder:
        return RunFolder(posixpath.join(self.runs, run_id))

    def study_journal(self, study_name: str) -> str:
        """The journal file of an Optuna study kept in the store (``storage="store"`` of
        ``OptunaSearch``): ``studies/<study>.journal``."""
        return self.join("studies", f"{study_name}.journal")

    def checkpoint_epochs(self, run_id: str) -> list[int]:
        """Epochs of ``run_id`` with a checkpoint, ascending."""
        folder = self.run(run_id).checkpoints
        if not self.exists(folder):
            return []
        names = (posixpath.basename(p) for p in self.fs.ls(folder, detail=False))
        return sorted(int(m.group(1)) for n in names if (m := _CHECKPOINT.fullmatch(n)))

    # -- files ---------------------------------------------------------------------------
    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def read_bytes(self, path: str) -> bytes:
        with self.fs.open(path, "rb") as f:
            return f.read()

    @contextmanager
    def open_atomic(self, path: str) -> Iterator[IO[bytes]]:
        """A binary file for writing that becomes ``path`` only when the block ends without
        an error: it is written as a hidden temporary sibling (``.tmp-<id>-<name>``, which
        Parquet readers skip), then moved into place; on an error it is removed."""
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        tmp = hidden_sibling(path)
        try:
            with self.fs.open(tmp, "wb") as f:
                yield f
            self.fs.mv(tmp, path)
        except BaseException:
            self.remove(tmp)
            raise

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` atomically: a temporary sibling, then a move."""
        with self.open_atomic(path) as f:
            f.write(data)

    def read_json(self, path: str) -> Any:
        return json.loads(self.read_bytes(path))

    def write_json(self, path: str, value: Any) -> None:
        self.write_bytes(path, json.dumps(value, indent=1, sort_keys=True).encode())

    def remove(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)
