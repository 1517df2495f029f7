"""Executor: one batch of the loader as tensors on the device, shaped for ``forward()``."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ...shared.spec import ColumnSpec, TrainSpec
from ..decode.decoded import MASK, Decoded
from ..decode.decoder import Decoder
from .columns import Columns, Layout
from .convert import chunk_rows, reshape_input


class Batch:
    """The tensors of one batch, decoded, transformed, moved to the device and shaped for
    forward(). ``size`` is its rows; ``drawn`` the rows the loader gave it, which differ
    where rows that failed to decode were left out (``Decoder``, bad_rows="skip").
    ``decoded``: the ``decoder``'s result for ``chunk``, where decoded ahead
    (``Decoder.ahead``); else it is decoded here.

    A padded sequence column (``Decoded.masks``) is two arguments of forward(): its values
    ``[rows, longest]`` and its mask (True at each row's values); for a
    ``transformation_fn`` and Lightning the mask is the column ``<name>_mask``."""

    def __init__(
        self,
        chunk: Mapping,
        spec: TrainSpec,
        device: torch.device,
        transform=None,
        decoder: Decoder | None = None,
        epoch: int | None = None,
        decoded: tuple[Decoded, np.ndarray | None] | None = None,
    ):
        self.drawn = chunk.rows if isinstance(chunk, Columns) else chunk_rows(chunk)
        masks: dict[str, torch.Tensor] = {}
        if decoder is not None:
            if not isinstance(chunk, Columns):  # a resized epoch's rest (remainder_batches)
                chunk = Layout(chunk, spec.data.columns).assemble(chunk)
            decoded, kept = decoded if decoded is not None else decoder(chunk, epoch)
            decoder.on_device(decoded, device, epoch)
            if kept is not None:
                chunk = chunk.take(kept)
            masks = decoded.masks
            fixed = to_device(chunk, spec.data.columns, device) if len(chunk.layout.names) else {}
            chunk = {**{n: fixed[n] for n in fixed}, **_on(decoded.columns, device)}
            masks = _on(masks, device)
            self.size = decoded.rows
        else:
            self.size = self.drawn
        if transform is not None:  # it gets (and returns) a plain dict of tensors
            given = {**dict(chunk), **{n + MASK: m for n, m in masks.items()}}
            out = apply_transformation(transform, given, spec.data.columns, self.size)
            masks = {n: out.get(n + MASK, m) for n, m in masks.items()}
            chunk = out
        shapes = spec.input_shapes or [None] * len(spec.data.features)
        if chunk and decoder is None and next(iter(chunk.values())).device != device:
            chunk = to_device(chunk, spec.data.columns, device)
        for c, shape in zip(spec.data.features, shapes):
            if shape is not None and c.name in masks:
                check_not_ragged(c.name, masks[c.name], shape)
        self.features = [
            reshape_input(c.name, chunk[c.name], shape)
            for c, shape in zip(spec.data.features, shapes)
        ]
        self.inputs = []  # forward()'s arguments: each feature, a sequence's mask after it
        for c, tensor in zip(spec.data.features, self.features):
            self.inputs += [tensor, masks[c.name]] if c.name in masks else [tensor]
        self.masks = masks
        self.labels = [chunk[c.name] for c in spec.data.labels]
        weight = spec.data.sample_weight
        self.sample_weight = chunk[weight.name] if weight is not None else None

    def tensors(self) -> list[torch.Tensor]:
        values = [*self.inputs, *self.labels] + (
            [self.sample_weight] if self.sample_weight is not None else []
        )
        return [v for v in values if isinstance(v, torch.Tensor)]


def check_not_ragged(name: str, mask: torch.Tensor, shape: list[int]) -> None:
    """``input_shapes`` cannot shape a sequence whose rows differ in length (``mask``: its
    padded batch's, True at the rows' own values)."""
    lengths = mask.sum(1)
    if len(lengths) and lengths.min() != lengths.max():
        raise ValueError(
            f"input_shapes: column '{name}' holds sequences whose rows vary in length "
            f"({int(lengths.min())} to {int(lengths.max())} values in this batch), padded "
            f"per batch to the longest; input_shapes ({shape}) cannot shape a sequence: "
            "leave input_shapes out (forward() gets the padded values and their mask), or "
            "give a decode_fn that pads or cuts every row to one length"
        )


def _on(columns: dict, device: torch.device) -> dict:
    """Decoded columns on ``device`` (tensors; lists of strings stay as they are)."""
    cuda = device.type == "cuda"
    return {
        n: v.to(device, non_blocking=cuda) if isinstance(v, torch.Tensor) else v
        for n, v in columns.items()
    }


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
        if c.variable and isinstance(value, list):  # strings (or objects) left as they are
            continue
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
