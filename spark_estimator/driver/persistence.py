"""Driver: Spark ML save/load for stages that hold Python objects (modules, optimizers),
through fsspec: any local path or fsspec URL (``s3://``, ``hdfs://``, ...), and no
SparkContext or JVM, so it works on Spark Connect too.

A saved stage is a folder with Spark ML's standard ``metadata/`` (a ``part-00000`` file of
one JSON line: class, uid, JSON params, extra metadata; and an empty ``_SUCCESS``), which
pyspark's ``DefaultParamsReader`` reads, so Pipelines can hold our stages; ``objects.pkl``,
a cloudpickle of the object-valued params; and, for a stage with weights (a TorchModel),
``weights.pt``: the module's state dict, which the pickle refers to instead of holding the
tensors, loaded with ``torch.load(weights_only=True)``. ``metadata/`` is written last, so an
interrupted save is refused by ``load``.

The filesystem comes from ``fsspec.core.url_to_fs(path, **options)``, after Spark's one-slash
URLs (``dbfs:/x``, ``file:/x``) are placed as the store places them (``store.spark_url``):
options given with
``write().option(key, value)`` or ``read().option(key, value)`` (fsspec storage options, e.g.
``key``, ``secret``, ``endpoint_url`` for s3), on top of fsspec's own configuration
(``FSSPEC_S3_ENDPOINT_URL``-style environment variables, its config files) and the
filesystem's defaults (for S3: the AWS environment variables, profiles, instance roles).
The options stay in the writer or reader: they are never saved.

Loading ``objects.pkl`` unpickles code: load only what you trust (see docs/security.md).
Credentials are never saved: a ``Store`` in the objects is pickled without its
``storage_options`` (``serialization.dumps_for_saving``), the estimator's metadata holds
only the store's URL.

``save(path)`` refuses an existing path; ``write().overwrite().save(path)`` replaces it.
Either way the stage is written whole into a hidden sibling folder first and then moved to
``path``, and an existing stage is moved aside only once its replacement is complete, so a
save that fails (an object that cannot be pickled, a full disk) or is killed never leaves a
half-written stage at ``path`` and never loses the one that was there.

A stage that holds stages (OptunaSearch its estimator and evaluator, OptunaSearchModel its
best model) writes each into a folder of its name inside its own, as Spark ML's tuners do
(``NestedStagesReadWrite``).
"""

from __future__ import annotations

import importlib
import json
import posixpath
import time
from typing import Any

import fsspec
import pyspark
from fsspec.implementations.local import LocalFileSystem
from pyspark.ml.util import DefaultParamsReader, MLReadable, MLReader, MLWritable, MLWriter

from ..shared.serialization import dumps_for_saving, loads_saved
from ..store import hidden_sibling, spark_url
from .params import json_params

OBJECTS_FILE = "objects.pkl"
WEIGHTS_FILE = "weights.pt"
METADATA_DIR = "metadata"
METADATA_FILE = "part-00000"  # Spark's text writer's name, as pyspark reads any part file
SUCCESS_FILE = "_SUCCESS"
REPLACED_PREFIX = ".replaced-"  # an overwritten stage, removed once its replacement is in place


def metadata_json(instance, extra: dict) -> str:
    """Spark ML's metadata line for ``instance`` (as ``DefaultParamsWriter`` makes it)."""
    metadata = {
        "class": f"{type(instance).__module__}.{type(instance).__name__}",
        "timestamp": int(round(time.time() * 1000)),
        "sparkVersion": pyspark.__version__,
        "uid": instance.uid,
        "paramMap": json_params(instance),
        "defaultParamMap": {p.name: v for p, v in instance._defaultParamMap.items()},
        **extra,
    }
    return json.dumps(metadata, separators=(",", ":"))


def write_metadata(fs: fsspec.AbstractFileSystem, path: str, line: str) -> None:
    folder = posixpath.join(path, METADATA_DIR)
    fs.makedirs(folder, exist_ok=True)
    fs.pipe_file(posixpath.join(folder, METADATA_FILE), (line + "\n").encode())
    fs.pipe_file(posixpath.join(folder, SUCCESS_FILE), b"")


def read_metadata(fs: fsspec.AbstractFileSystem, path: str, where: str) -> dict:
    """The first line of the first part file of ``metadata/`` (also Spark's own
    ``part-00000-<id>.txt``), parsed."""
    folder = posixpath.join(path, METADATA_DIR)
    names = sorted(p for p in fs.find(folder) if posixpath.basename(p).startswith("part-"))
    if not names:
        raise FileNotFoundError(f"path: '{where}' holds no saved Spark ML stage (no {folder})")
    with fs.open(names[0], "rb") as f:
        return DefaultParamsReader._parseMetaData(f.readline().decode())


class _FsspecOptions:
    """``option(key, value)``: fsspec storage options for the path, kept as given (not
    lower-cased or turned into strings as Spark's own options are)."""

    def _init_options(self) -> None:
        self.storage_options: dict[str, Any] = {}

    def option(self, key: str, value: Any):
        self.storage_options[key] = value
        return self

    def _fs(self, path: str) -> tuple[fsspec.AbstractFileSystem, str]:
        return fsspec.core.url_to_fs(spark_url(path, "path"), **self.storage_options)


def in_store(io, store, path: str) -> str:
    """The URL of ``path`` in ``store`` (a ``Store``) for ``io``, a writer or reader of
    ours, on which the store's storage options are set."""
    url, options = store.fsspec_target(path)
    for key, value in options.items():
        io.option(key, value)
    return url


class ObjectParamsWriter(_FsspecOptions, MLWriter):
    """Writes ``instance``: JSON params to metadata, ``instance._objects()`` to a pickle,
    the tensors of ``instance._weights()`` (when it has that method) to a weights file."""

    def __init__(self, instance):
        super().__init__()
        self._init_options()
        self.instance = instance

    def save(self, path: str) -> None:
        """Refuse an existing ``path`` unless ``overwrite()``; write the stage beside it, then
        move it into place (with fsspec, not Spark's Hadoop filesystem)."""
        fs, fs_path = self._fs(path)
        existed = fs.exists(fs_path)
        if existed and not self.shouldOverwrite:
            raise FileExistsError(
                f"path: '{path}' already exists; use stage.write().overwrite().save(path) "
                "to replace it"
            )
        staging = hidden_sibling(fs_path)
        try:
            self._write_stage(fs, staging)
            move_into_place(fs, staging, fs_path, existed)
        except BaseException:
            if fs.exists(staging):
                fs.rm(staging, recursive=True)
            raise

    def _write_stage(self, fs: fsspec.AbstractFileSystem, fs_path: str) -> None:
        weights = self.instance._weights() if hasattr(self.instance, "_weights") else None
        objects, weights_file = dumps_for_saving(
            self.instance._objects(), type(self.instance).__name__, weights
        )
        line = metadata_json(self.instance, self.instance._extra_metadata())
        fs.makedirs(fs_path, exist_ok=True)
        if weights_file is not None:
            fs.pipe_file(posixpath.join(fs_path, WEIGHTS_FILE), weights_file)
        fs.pipe_file(posixpath.join(fs_path, OBJECTS_FILE), objects)
        write_metadata(fs, fs_path, line)  # last: a stage without it is refused by load


def move_into_place(
    fs: fsspec.AbstractFileSystem, staging: str, fs_path: str, existed: bool
) -> None:
    """Move the complete stage ``staging`` to ``fs_path``. An existing stage there is moved
    aside first and removed only after the move; if the move fails, it is moved back.

    On a local filesystem each move is one rename. On an object store a move is a copy of
    each file and a delete, so a stage being replaced there is briefly absent (or, if the
    process dies in that moment, left complete at ``.replaced-<id>-<name>`` beside it).
    """
    replaced = hidden_sibling(fs_path, REPLACED_PREFIX) if existed else None
    if replaced:
        move_folder(fs, fs_path, replaced)
    try:
        move_folder(fs, staging, fs_path)
    except BaseException:
        if replaced:
            if fs.exists(fs_path):  # part of the new stage, copied to an object store
                fs.rm(fs_path, recursive=True)
            move_folder(fs, replaced, fs_path)
        raise
    if replaced:
        fs.rm(replaced, recursive=True)


def move_folder(fs: fsspec.AbstractFileSystem, source: str, target: str) -> None:
    """Move the stage folder ``source`` to ``target``, which does not exist: one rename on a
    local filesystem; elsewhere (object stores, where a folder is a key prefix and fsspec's
    folder moves differ between implementations) a copy of each file, ``metadata/`` last,
    then the removal of ``source``."""
    if isinstance(fs, LocalFileSystem):
        fs.mv(source, target)
        return
    names = sorted(
        (posixpath.relpath(path, source) for path in fs.find(source)),
        key=lambda name: name.startswith(METADATA_DIR + "/"),
    )
    for name in names:
        fs.copy(posixpath.join(source, name), posixpath.join(target, name))
    fs.rm(source, recursive=True)


class ObjectParamsReader(_FsspecOptions, MLReader):
    """Reads what ObjectParamsWriter wrote into a new instance of ``cls``."""

    def __init__(self, cls):
        super().__init__()
        self._init_options()
        self.cls = cls

    def load(self, path: str) -> Any:
        expected = f"{self.cls.__module__}.{self.cls.__name__}"
        fs, fs_path = self._fs(path)
        metadata = read_metadata(fs, fs_path, path)
        if metadata["class"] != expected:
            raise TypeError(f"path: '{path}' holds a {metadata['class']}, not a {expected}")
        weights_path = posixpath.join(fs_path, WEIGHTS_FILE)
        weights = None
        if fs.exists(weights_path):  # written where a module had tensors (a TorchModel)
            weights = fs.cat_file(weights_path)
        objects = loads_saved(fs.cat_file(posixpath.join(fs_path, OBJECTS_FILE)), weights)
        instance = self.cls()  # loads_saved unpickled code: it trusts the saved stage
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        instance._restore(objects, metadata)
        return instance


class ObjectParamsReadWrite(MLReadable, MLWritable):
    """Spark ML's ``write()`` and ``read()`` for a stage saved as above."""

    def write(self) -> ObjectParamsWriter:
        return ObjectParamsWriter(self)

    @classmethod
    def read(cls) -> ObjectParamsReader:
        return ObjectParamsReader(cls)


class NestedStagesWriter(ObjectParamsWriter):
    """Also writes the stages a stage holds (``instance._nested()``: name -> stage, None
    where unset), each into the folder of its name, before the stage's own metadata: ours
    through fsspec as above, Spark's own (an Evaluator) with their own writer."""

    def _write_stage(self, fs: fsspec.AbstractFileSystem, fs_path: str) -> None:
        for name, stage in self.instance._nested().items():
            if stage is None:
                continue
            folder = posixpath.join(fs_path, name)
            writer = stage.write()
            if isinstance(writer, ObjectParamsWriter):
                writer.storage_options = self.storage_options
                writer._write_stage(fs, folder)
            else:
                writer.overwrite().save(fs.unstrip_protocol(folder))
        super()._write_stage(fs, fs_path)


class NestedStagesReader(ObjectParamsReader):
    """Reads what NestedStagesWriter wrote: the stage, then each of its stages (by the
    class its metadata names), handed to ``instance._restore_nested``."""

    def load(self, path: str) -> Any:
        instance = super().load(path)
        fs, fs_path = self._fs(path)
        stages = {}
        for name in instance._NESTED:
            folder = posixpath.join(fs_path, name)
            if not fs.exists(folder):
                continue
            metadata = read_metadata(fs, folder, posixpath.join(path, name))
            # a JVM stage's class is named as Scala's; pyspark's is the same in pyspark
            python_class = metadata["class"].replace("org.apache.spark.", "pyspark.", 1)
            module, _, cls_name = python_class.rpartition(".")
            cls = getattr(importlib.import_module(module), cls_name)
            reader = cls.read()
            if isinstance(reader, ObjectParamsReader):
                reader.storage_options = self.storage_options
                stages[name] = reader.load(posixpath.join(path, name))
            else:
                stages[name] = reader.load(fs.unstrip_protocol(folder))
        instance._restore_nested(stages)
        return instance


class NestedStagesReadWrite(MLReadable, MLWritable):
    """Spark ML's ``write()`` and ``read()`` for a stage that holds stages (``_NESTED``)."""

    _NESTED: tuple[str, ...] = ()

    def write(self) -> NestedStagesWriter:
        return NestedStagesWriter(self)

    @classmethod
    def read(cls) -> NestedStagesReader:
        return NestedStagesReader(cls)
