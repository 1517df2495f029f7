"""Executor: decoded rows made one batch, as a ``DataLoader``'s ``collate_fn`` makes it:
the user's ``collate_fn``, or column by column tensors of one shape stacked (``stack_rows``:
channels-last images into a channels-last batch), 1-D tensors (sequences) padded to the
longest with their mask (``pad_sequences``), numbers as one tensor, other values listed.
An ``allocate`` (a decode worker's) says where a stacked column may go: its shared memory
slot, so that the batch is stacked once, straight where its rank reads it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...decoding.augment import _channels_innermost
from ...shared.spec import ColumnSpec, column_param
from .decoded import MASK, Decoded

LABEL_PADDING = -100  # integer sequence labels: the index CrossEntropyLoss ignores

# (shape, dtype) -> a contiguous CPU tensor to stack a batch's rows into, or None
Allocate = Callable[[tuple[int, ...], torch.dtype], "torch.Tensor | None"]


class Collation:
    """How the rows of ``columns`` (``labels`` among them) make a batch: ``collate_fn``'s
    way, or column by column (see the module); sequences padded with ``padding_value``."""

    def __init__(
        self,
        columns: list[ColumnSpec],
        labels: frozenset[str],
        padding_value: float,
        collate_fn: Callable | None,
    ):
        self.columns, self.labels = columns, labels
        self.padding_value, self.collate_fn = padding_value, collate_fn

    def rows(
        self,
        rows: list[dict],
        padding: list[int],
        skip: set[str] = frozenset(),
        allocate: Allocate | None = None,
    ) -> Decoded:
        """The decoded ``rows`` as one batch; the values of padded sequences added to
        ``padding``; the columns ``skip`` left out (decoded a batch at a time); stacked
        columns where ``allocate`` gives room."""
        if self.collate_fn is not None:
            out = self.collate_fn(rows)
            if not isinstance(out, dict):
                raise TypeError(
                    f"collate_fn: must return a dict of column -> tensor, got {type(out).__name__}"
                )
            masks = {n[: -len(MASK)]: m for n, m in out.items() if n.endswith(MASK)}
            columns = {n: v for n, v in out.items() if not n.endswith(MASK)}
            return Decoded(columns, masks, len(rows))
        columns, masks = {}, {}
        for c in self.columns:
            if c.name in skip:
                continue
            label = c.name in self.labels
            column = [row[c.name] for row in rows]
            columns[c.name], mask = self.column(c.name, column, label, padding, allocate)
            if mask is not None and not label:
                masks[c.name] = mask
        return Decoded(columns, masks, len(rows))

    def column(
        self,
        name: str,
        values: list,
        label: bool,
        padding: list[int],
        allocate: Allocate | None = None,
    ):
        """One column's rows: tensors of one shape stacked; 1-D tensors (sequences) padded
        to the longest, with their mask; numbers as one tensor; other objects as a list."""
        if not values or not all(isinstance(v, torch.Tensor) for v in values):
            if values and all(isinstance(v, (int, float)) for v in values):
                return torch.tensor(values), None
            return values, None
        if all(v.dim() == 1 for v in values):
            integral = not values[0].is_floating_point()
            fill = LABEL_PADDING if label and integral else self.padding_value
            padded, mask = pad_sequences(values, fill)
            padding[0] += int(mask.sum())
            padding[1] += mask.numel()
            return padded, mask
        shapes = {tuple(v.shape) for v in values}
        if len(shapes) > 1:
            a, b = sorted(shapes)[:2]
            role = "label" if label else "feature"
            if len(a) == len(b) == 3 and a[1:] == b[1:]:  # images of other channel counts
                raise ValueError(
                    f"{column_param(role)}: column '{name}' has images of {a[0]} and {b[0]} "
                    f"channels in one batch ({'x'.join(map(str, a))} and "
                    f"{'x'.join(map(str, b))}); give decode_fn that decodes them in one mode "
                    "(spark_estimator.decoding.decode_image(row[...], mode='RGB'), or 'L' for "
                    "grayscale)"
                )
            raise different_shapes(name, role, [a, b])
        return stack_rows(values, allocate), None


def different_shapes(name: str, role: str, shapes: list[tuple[int, ...]]) -> ValueError:
    """The error of a batch whose rows of column ``name`` have ``shapes`` (its first two)."""
    sizes = " and ".join("x".join(map(str, s)) for s in shapes)
    return ValueError(
        f"{column_param(role)}: column '{name}' has rows of different shapes in one batch "
        f"({sizes}); give decode_fn that resizes or crops them to one size "
        "(spark_estimator.decoding.decode_image with size=, center_crop, random_crop), or a "
        "collate_fn"
    )


def stack_rows(values: list[torch.Tensor], allocate: Allocate | None = None) -> torch.Tensor:
    """Tensors of one shape as one batch, in the first's memory order: images ``[C, H, W]``
    whose channels are innermost in memory (``decode_image``'s, their crops and flips) make
    a channels-last batch ``[B, C, H, W]`` (each row one run of memory to copy, where
    stacking them as a contiguous batch moves every pixel's channels apart); other tensors
    are stacked as they are (contiguous). With ``allocate`` (a decode worker's: memory in
    its shared slot), the batch is stacked straight into the memory it gives."""
    first = values[0]
    channels_last = _channels_innermost(first)
    rows = [v.permute(1, 2, 0) for v in values] if channels_last else values
    out = None
    same = all(v.dtype == first.dtype for v in values)
    if allocate is not None and first.device.type == "cpu" and same:
        out = allocate((len(rows), *rows[0].shape), first.dtype)
    stacked = torch.stack(rows) if out is None else torch.stack(rows, out=out)
    return stacked.permute(0, 3, 1, 2) if channels_last else stacked


def pad_sequences(values: list[torch.Tensor], fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D tensors as one ``[rows, longest]`` tensor padded with ``fill``, and the mask
    (True at each row's own values)."""
    longest = max((len(v) for v in values), default=0)
    padded = torch.full((len(values), longest), fill, dtype=values[0].dtype if values else None)
    mask = torch.zeros((len(values), longest), dtype=torch.bool)
    for i, v in enumerate(values):
        padded[i, : len(v)] = v
        mask[i, : len(v)] = True
    return padded, mask
