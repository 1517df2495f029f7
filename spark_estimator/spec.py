"""Plain data handed from the driver to the executors (pickled into the barrier job).

No Spark imports here: the executor side reads these, the driver side builds them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .store import Store

DATASET_FORMAT_VERSION = 1
SPLITS = ("train", "validation")


@dataclass(frozen=True)
class ColumnSpec:
    """How one input column is materialized and turned into a tensor."""

    name: str
    kind: str  # "scalar" | "array" | "vector"
    integral: bool  # integral labels stay int64 (class indices); everything else is float32

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.int64 if self.integral else torch.float32


@dataclass
class DatasetInfo:
    """Where a materialized dataset lives in the store and how its rows are laid out."""

    path: str  # the dataset folder in the store
    features: list[ColumnSpec]
    labels: list[ColumnSpec]
    # split -> [(file path relative to ``path``, [rows of each row group])]
    files: dict[str, list[tuple[str, list[int]]]]
    reused: bool = False  # found complete in the store rather than written by this fit

    def rows(self, split: str) -> int:
        return sum(sum(groups) for _, groups in self.files.get(split, []))

    def to_json(self) -> dict:
        return {
            "format_version": DATASET_FORMAT_VERSION,
            "features": [asdict(c) for c in self.features],
            "labels": [asdict(c) for c in self.labels],
            "files": self.files,
            "rows": {s: self.rows(s) for s in SPLITS},
        }

    @classmethod
    def from_json(cls, path: str, meta: dict, reused: bool) -> DatasetInfo:
        return cls(
            path=path,
            features=[ColumnSpec(**c) for c in meta["features"]],
            labels=[ColumnSpec(**c) for c in meta["labels"]],
            files={s: [(f, list(g)) for f, g in files] for s, files in meta["files"].items()},
            reused=reused,
        )


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
