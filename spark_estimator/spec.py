"""Plain data handed from the driver to the executors (pickled into the barrier job).

No Spark imports here: the executor side reads these, the driver side builds them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .store import Store

DATASET_FORMAT_VERSION = 2
SPLITS = ("train", "validation")
FLOAT_DTYPES = ("float32", "float64")
READERS = ("arrow", "petastorm")
_TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}


@dataclass(frozen=True)
class ColumnSpec:
    """How one input column is stored in Parquet and turned into a tensor."""

    name: str
    kind: str  # "scalar" | "array" | "vector" (an ML vector; materialized as an array)
    dtype: str  # "float32" | "float64" | "int64" (integral labels: class indices)

    @property
    def integral(self) -> bool:
        return self.dtype == "int64"

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.dtype]


@dataclass
class DatasetInfo:
    """Where a Parquet dataset lives in the store and how its rows are laid out."""

    path: str  # the dataset folder in the store; file paths below are relative to it
    features: list[ColumnSpec]
    labels: list[ColumnSpec]
    # split -> [(file path relative to ``path``, [rows of each row group])]
    files: dict[str, list[tuple[str, list[int]]]]
    reused: bool = False  # found complete in the store rather than written by this fit
    source: dict = field(default_factory=dict)  # what the cache key was computed from

    @property
    def columns(self) -> list[ColumnSpec]:
        return self.features + self.labels

    def rows(self, split: str) -> int:
        return sum(sum(groups) for _, groups in self.files.get(split, []))

    def to_json(self) -> dict:
        return {
            "format_version": DATASET_FORMAT_VERSION,
            "features": [asdict(c) for c in self.features],
            "labels": [asdict(c) for c in self.labels],
            "files": self.files,
            "rows": {s: self.rows(s) for s in SPLITS},
            "source": self.source,
        }

    @classmethod
    def from_json(cls, path: str, meta: dict, reused: bool) -> DatasetInfo:
        return cls(
            path=path,
            features=[ColumnSpec(**c) for c in meta["features"]],
            labels=[ColumnSpec(**c) for c in meta["labels"]],
            files={s: [(f, list(g)) for f, g in files] for s, files in meta["files"].items()},
            reused=reused,
            source=meta.get("source", {}),
        )


@dataclass(frozen=True)
class LoaderSpec:
    """How each rank reads its shard (the loader parameters of TorchEstimator)."""

    reader: str = "arrow"  # "arrow" | "petastorm"
    shuffle: bool = True
    shuffle_buffer_size: int | None = None  # rows; None: as many as fit in 256 MiB
    num_workers: int = 2  # background reader threads
    inmemory_cache_all: bool = False
    train_steps_per_epoch: int | None = None
    validation_steps_per_epoch: int | None = None
    transformation_fn: bytes | None = None  # cloudpickled fn(dict of tensors) -> dict


@dataclass
class TrainSpec:
    """Everything a training task needs besides its BarrierTaskContext."""

    bundle: bytes  # cloudpickle of (model, optimizer, loss)
    data: DatasetInfo
    store: Store
    run_id: str
    batch_size: int
    epochs: int
    seed: int
    use_gpu: bool
    input_shapes: list[list[int]] | None
    loader: LoaderSpec = field(default_factory=LoaderSpec)
