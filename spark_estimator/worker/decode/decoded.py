"""Executor: what decoding is made from and what it gives, the same in threads and in
decode worker processes: ``Recipe`` (picklable: a worker process gets it), ``Decoded`` (one
batch's tensors), ``BatchResult`` (a batch and what its decoding reported) and ``BadRow``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...shared.spec import ColumnSpec, DecodeSpec

MASK = "_mask"  # the suffix of a padded column's mask in a collated batch


class BadRow(ValueError):
    """A row that could not be decoded (the column or decode_fn, its index and name)."""


class Decoded(Mapping):
    """One batch after decoding: column name -> tensor (or list, for strings left as
    they are), the ``masks`` of its padded feature sequences, and its ``rows``."""

    def __init__(self, columns: dict[str, Any], masks: dict[str, torch.Tensor], rows: int):
        self.columns, self.masks, self.rows = columns, masks, rows
        self.rows_of = None  # (row indices, names) of a batch left for decode_batch_fn on a GPU

    def __getitem__(self, name: str):
        return self.columns[name]

    def __iter__(self):
        return iter(self.columns)

    def __len__(self) -> int:
        return len(self.columns)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Its tensors by name, masks as ``<column>_mask``."""
        out = {n: v for n, v in self.columns.items() if isinstance(v, torch.Tensor)}
        return {**out, **{n + MASK: m for n, m in self.masks.items()}}

    def empty(self) -> Decoded:
        """Zero rows of each column, as decoded (tensors of their own: none views this
        batch's memory, which may be a worker's slot)."""
        columns = {n: _none_of(v) for n, v in self.columns.items()}
        return Decoded(columns, {n: _none_of(m) for n, m in self.masks.items()}, 0)


def _none_of(value):
    return value[:0].clone() if isinstance(value, torch.Tensor) else value[:0]


@dataclass
class BatchResult:
    """What decoding one batch gives: the batch (None when no row was kept), the positions
    of the rows kept (None: all), the rows left out as (validation?, row index), and the
    values of the padded sequences collated: [their own, with the padding]."""

    decoded: Decoded | None
    kept: np.ndarray | None = None
    skipped: list[tuple[bool, int]] = field(default_factory=list)
    padding: list[int] = field(default_factory=lambda: [0, 0])
    ready: Any = None  # the CUDA event its tensors' copies to the GPU end with (``delivery``)


@dataclass(frozen=True)
class Recipe:
    """What a ``BatchDecoding`` is made from (picklable: a decode worker process gets it)."""

    spec: DecodeSpec
    columns: tuple[ColumnSpec, ...]  # the variable columns decoded
    labels: frozenset[str]  # which of them are labels
    seed: int
    row_names: str | None = None  # the column naming each row (``path``)
    fit_labels: tuple[str, ...] | None = None  # transform: the fit's label columns
