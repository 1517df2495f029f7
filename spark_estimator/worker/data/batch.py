"""Executor: one batch of the loader as tensors on the device, shaped for ``forward()``."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ...shared.spec import ColumnSpec, TrainSpec
from .columns import Columns, Layout
from .convert import chunk_rows, reshape_input


class Batch:
    """The tensors of one batch, transformed, moved to the device and shaped for forward()."""

    def __init__(self, chunk: Mapping, spec: TrainSpec, device: torch.device, transform=None):
        self.size = chunk.rows if isinstance(chunk, Columns) else chunk_rows(chunk)
        if transform is not None:  # it gets (and returns) a plain dict of tensors
            chunk = apply_transformation(transform, dict(chunk), spec.data.columns, self.size)
        shapes = spec.input_shapes or [None] * len(spec.data.features)
        if chunk and next(iter(chunk.values())).device != device:
            chunk = to_device(chunk, spec.data.columns, device)
        self.inputs = [
            reshape_input(c.name, chunk[c.name], shape)
            for c, shape in zip(spec.data.features, shapes)
        ]
        self.labels = [chunk[c.name] for c in spec.data.labels]
        weight = spec.data.sample_weight
        self.sample_weight = chunk[weight.name] if weight is not None else None

    def tensors(self) -> list[torch.Tensor]:
        return [*self.inputs, *self.labels] + (
            [self.sample_weight] if self.sample_weight is not None else []
        )


def to_device(chunk: Mapping, columns: list[ColumnSpec], device: torch.device) -> Columns:
    """A host batch's columns on ``device``: the scalar columns of one dtype as one
    ``[rows, columns]`` block, one copy (from pinned memory, not blocking the host, on a
    GPU), each column a strided view of it; every other column copied by itself
    (``Columns.to``). The loader's batches come laid out so (``Columns``, in its pinned
    buffer); a plain dict (a ``transformation_fn``'s) is laid out first, into pinned memory
    on a GPU. Marking a column's tensor for a stream (``record_stream``) marks its whole
    block: it acts on the tensor's storage."""
    if not isinstance(chunk, Columns):
        chunk = Layout(chunk, columns).assemble(chunk, pin=device.type == "cuda")
    return chunk.to(device)


def apply_transformation(fn, chunk: dict, columns: list[ColumnSpec], rows: int) -> dict:
    """``transformation_fn`` on one batch, checked: same columns present, same row count."""
    return check_transformed(fn(chunk), columns, rows)


def check_transformed(out, columns: list[ColumnSpec], rows: int) -> dict:
    """What ``transformation_fn`` returned, if a dict with a tensor of ``rows`` rows for
    each column; else a TypeError or ValueError naming ``transformation_fn``."""
    if not isinstance(out, dict):
        raise TypeError(
            f"transformation_fn: must return a dict of tensors, got {type(out).__name__}"
        )
    for c in columns:
        value = out.get(c.name)
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"transformation_fn: the returned dict has no tensor for column '{c.name}'"
            )
        if len(value) != rows:
            raise ValueError(
                f"transformation_fn: column '{c.name}' has {len(value)} rows after the "
                f"transformation, the batch had {rows}; it must keep every row"
            )
    return out
