"""Driver: Spark ML save/load for stages that hold Python objects (modules, optimizers).

A saved stage is a folder with Spark ML's standard ``metadata/`` (class, uid, JSON params,
extra metadata; readable by ``DefaultParamsReader``, so Pipelines can hold our stages),
``objects.pkl``, a cloudpickle of the object-valued params, and, for a stage with weights
(a TorchModel), ``weights.pt``: the module's state dict, which the pickle refers to instead
of holding the tensors, loaded with ``torch.load(weights_only=True)``.

Loading ``objects.pkl`` unpickles code: load only what you trust (see docs/security.md).
Credentials are never saved: a ``Store`` in the objects is pickled without its
``storage_options`` (``serialization.dumps_for_saving``), the estimator's metadata holds
only the store's URL.

``save(path)`` refuses an existing path; ``write().overwrite().save(path)`` replaces it.
"""

from __future__ import annotations

import posixpath
from typing import Any

import fsspec
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from .params import json_params
from .serialization import dumps_for_saving, loads_saved

OBJECTS_FILE = "objects.pkl"
WEIGHTS_FILE = "weights.pt"


class ObjectParamsWriter(MLWriter):
    """Writes ``instance``: JSON params to metadata, ``instance._objects()`` to a pickle,
    the tensors of ``instance._weights()`` (when it has that method) to a weights file."""

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
        weights = self.instance._weights() if hasattr(self.instance, "_weights") else None
        objects, weights_file = dumps_for_saving(
            self.instance._objects(), type(self.instance).__name__, weights
        )
        DefaultParamsWriter.saveMetadata(
            self.instance,
            path,
            self.sc,
            extraMetadata=self.instance._extra_metadata(),
            paramMap=json_params(self.instance),
        )
        if weights_file is not None:
            with fs.open(posixpath.join(fs_path, WEIGHTS_FILE), "wb") as f:
                f.write(weights_file)
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
        weights_path = posixpath.join(fs_path, WEIGHTS_FILE)
        weights = None
        if fs.exists(weights_path):  # stages saved before weights.pt hold their tensors inline
            with fs.open(weights_path, "rb") as f:
                weights = f.read()
        with fs.open(posixpath.join(fs_path, OBJECTS_FILE), "rb") as f:
            objects = loads_saved(f.read(), weights)  # unpickles: trusts the saved stage
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        instance._restore(objects, metadata)
        return instance
