"""Driver: Spark ML save/load for stages that hold Python objects (modules, optimizers).

A saved stage is a folder with Spark ML's standard ``metadata/`` (class, uid, JSON params,
extra metadata; readable by ``DefaultParamsReader``, so Pipelines can hold our stages) and
``objects.pkl``, a cloudpickle of the object-valued params. Loading it unpickles code and
data: load only what you trust.

``save(path)`` refuses an existing path; ``write().overwrite().save(path)`` replaces it.
"""

from __future__ import annotations

import posixpath
from typing import Any

import fsspec
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from .params import json_params
from .serialization import dumps, loads

OBJECTS_FILE = "objects.pkl"


class ObjectParamsWriter(MLWriter):
    """Writes ``instance``: JSON params to metadata, ``instance._objects()`` to a pickle."""

    def __init__(self, instance):
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        fs, fs_path = fsspec.core.url_to_fs(path)
        if fs.exists(fs_path) and not self.shouldOverwrite:
            raise FileExistsError(
                f"path: '{path}' already exists; use stage.write().overwrite().save(path) "
                "to replace it"
            )
        objects = dumps(self.instance._objects(), type(self.instance).__name__)
        DefaultParamsWriter.saveMetadata(
            self.instance,
            path,
            self.sc,
            extraMetadata=self.instance._extra_metadata(),
            paramMap=json_params(self.instance),
        )
        with fs.open(posixpath.join(fs_path, OBJECTS_FILE), "wb") as f:
            f.write(objects)


class ObjectParamsReader(MLReader):
    """Reads what ObjectParamsWriter wrote into a new instance of ``cls``."""

    def __init__(self, cls):
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        expected = f"{self.cls.__module__}.{self.cls.__name__}"
        metadata = DefaultParamsReader.loadMetadata(path, self.sc)
        if metadata["class"] != expected:
            raise TypeError(f"path: '{path}' holds a {metadata['class']}, not a {expected}")
        fs, fs_path = fsspec.core.url_to_fs(path)
        with fs.open(posixpath.join(fs_path, OBJECTS_FILE), "rb") as f:
            objects = loads(f.read())
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        instance._restore(objects, metadata)
        return instance
