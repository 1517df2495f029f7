"""Executor: one batch of the loader as tensors on the device, shaped for ``forward()``."""

from __future__ import annotations

import torch

from ...shared.spec import ColumnSpec, TrainSpec
from .convert import Tensors, chunk_rows, reshape_input


class Batch:
    """The tensors of one batch, transformed, moved to the device and shaped for forward()."""

    def __init__(self, chunk: Tensors, spec: TrainSpec, device: torch.device, transform=None):
        self.size = chunk_rows(chunk)
        if transform is not None:
            chunk = apply_transformation(transform, chunk, spec.data.columns, self.size)
        shapes = spec.input_shapes or [None] * len(spec.data.features)
        non_blocking = device.type == "cuda"  # the loader's buffer is pinned on GPUs

        def to_device(name):
            return chunk[name].to(device, non_blocking=non_blocking)

        self.inputs = [
            reshape_input(c.name, to_device(c.name), shape)
            for c, shape in zip(spec.data.features, shapes)
        ]
        self.labels = [to_device(c.name) for c in spec.data.labels]
        weight = spec.data.sample_weight
        self.sample_weight = to_device(weight.name) if weight is not None else None


def apply_transformation(fn, chunk: dict, columns: list[ColumnSpec], rows: int) -> dict:
    """``transformation_fn`` on one batch, checked: same columns present, same row count."""
    out = fn(chunk)
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
