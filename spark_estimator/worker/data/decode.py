"""Executor: a batch's variable columns decoded row by row, in a pool of threads, and
collated into tensors.

The loader hands over batches whose variable columns (encoded images, Spark's image
structs, strings, arrays of varying length) are arrays of Python objects, in the rows'
seeded order. ``Decoder`` turns one such batch into tensors, as a PyTorch ``Dataset``'s
``__getitem__`` and a ``DataLoader``'s ``collate_fn`` would: each row's values go through
``decode_fn(row, augment)`` (``decoding.default_decode`` without one), the rows spread over
``workers`` threads (Pillow and tokenizers release the GIL while they work), then the
decoded rows through ``collate_fn`` (``collate`` without one).

``augment`` is a NumPy generator seeded by (seed, epoch, the row's index in its split)
when training, None otherwise: a row's transforms are the same whenever and on whichever
rank it is read, so an exact resume and an elastic resize see each row once per epoch with
the transforms it would have had. A row whose decoding raises fails the batch naming the
column (or ``decode_fn``), the row's index and name (binaryFile's ``path``, an image's
``origin``) with ``bad_rows="fail"``; with ``"skip"`` it is left out of its batch and
counted (each row once, however many epochs skip it). In ``transform`` (``fit_labels``
given) a row holds the variable feature columns only: a ``decode_fn`` that reads one of the
fit's label columns is told so, one that returns them anyway has them dropped, and a bad
row is named with what to filter.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ...decoding import default_decode
from ...shared.packages import require_gpu_jpeg
from ...shared.serialization import loads
from ...shared.spec import ColumnSpec, DecodeSpec, column_param
from .arrow_reader import ROW_ID

log = logging.getLogger(__name__)
LABEL_PADDING = -100  # integer sequence labels: the index CrossEntropyLoss ignores
MASK = "_mask"  # the suffix of a padded column's mask in a collated batch


class BadRow(ValueError):
    """A row that could not be decoded (the column or decode_fn, its index and name)."""


class Decoded(Mapping):
    """One batch after decoding: column name -> tensor (or list, for strings left as
    they are), the ``masks`` of its padded feature sequences, and its ``rows``."""

    def __init__(self, columns: dict[str, Any], masks: dict[str, torch.Tensor], rows: int):
        self.columns, self.masks, self.rows = columns, masks, rows

    def __getitem__(self, name: str):
        return self.columns[name]

    def __iter__(self):
        return iter(self.columns)

    def __len__(self) -> int:
        return len(self.columns)


def default_workers() -> int:
    """Decoding threads per rank: the CPUs the task may use (torch's intra-op threads are
    set to its share of the executor's cores)."""
    return max(1, min(torch.get_num_threads(), os.cpu_count() or 1))


class Decoder:
    """Decodes and collates the variable ``columns`` of batches (see the module)."""

    def __init__(
        self,
        spec: DecodeSpec,
        columns: list[ColumnSpec],
        labels: set[str],
        seed: int,
        row_names: str | None = None,
        fit_labels: list[str] | None = None,
    ):
        self.spec, self.seed, self.row_names = spec, seed, row_names
        # transform's decoder: the fit's label columns, which its rows do not hold
        self.fit_labels = fit_labels
        self.columns = [c for c in columns if c.variable]
        self.labels = labels
        self.kinds = {c.name: c.kind for c in self.columns}
        if spec.device == "cuda":  # encoded images are decoded on the GPU, per batch
            self.kinds = {n: ("bytes" if k == "binary" else k) for n, k in self.kinds.items()}
        self.decode_fn: Callable | None = loads(spec.decode_fn) if spec.decode_fn else None
        self.collate_fn: Callable | None = loads(spec.collate_fn) if spec.collate_fn else None
        self.workers = spec.workers or default_workers()
        self.pool = (
            ThreadPoolExecutor(self.workers, thread_name_prefix="spark-estimator-decode")
            if self.workers > 1
            else None
        )
        self.skipped_rows: set[tuple[bool, int]] = set()  # (validation?, row) left out
        self.padding = [0, 0]  # values of padded sequences: real, in all (with the padding)
        self.empty: Decoded | None = None  # zero rows of each column, as decoded (``prime``)

    def prime(self, first: Mapping) -> None:
        """Decode ``first`` (a split's first rows) once, not counted, to know the decoded
        columns' shapes: a batch without rows then gets zero rows of each."""
        decoded, _ = self(first, None)
        self.skipped_rows, self.padding = set(), [0, 0]
        if decoded.rows:
            columns = {n: v[:0] for n, v in decoded.columns.items()}
            masks = {n: m[:0] for n, m in decoded.masks.items()}
            self.empty = Decoded(columns, masks, 0)

    @property
    def skipped(self) -> int:
        """The rows left out (``bad_rows="skip"``), each counted once."""
        return len(self.skipped_rows)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def __call__(self, batch: Mapping, epoch: int | None) -> tuple[Decoded, np.ndarray | None]:
        """The batch's variable columns decoded (``epoch``: None when not training, so
        without augmentation), and the positions of the rows kept (None: all of them)."""
        values = {c.name: batch[c.name] for c in self.columns}
        rows = len(next(iter(values.values()))) if values else 0
        ids = batch[ROW_ID].numpy() if ROW_ID in batch else np.arange(rows)
        names = batch[self.row_names] if self.row_names else None
        spans = self._spans(rows)
        work = [(values, ids, names, epoch, start, stop) for start, stop in spans]
        parts = (
            list(self.pool.map(self._decode_rows, work))
            if self.pool
            else [self._decode_rows(w) for w in work]
        )
        decoded = [row for part in parts for row in part]
        kept = [i for i, row in enumerate(decoded) if row is not None]
        if len(kept) < rows:
            left_out = set(range(rows)).difference(kept)
            self.skipped_rows.update((epoch is None, int(ids[i])) for i in left_out)
        good = [decoded[i] for i in kept]
        collated = self.collate(good) if good or self.empty is None else self.empty
        kept_rows = None if len(kept) == rows else np.asarray(kept, dtype=np.int64)
        return collated, kept_rows

    def _spans(self, rows: int) -> list[tuple[int, int]]:
        """Contiguous row ranges, one per thread at most, not below 8 rows each."""
        parts = max(1, min(self.workers, math.ceil(rows / 8)))
        bounds = np.linspace(0, rows, parts + 1).astype(int)
        return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]

    def _decode_rows(self, work) -> list[dict | None]:
        values, ids, names, epoch, start, stop = work
        out = []
        for i in range(start, stop):
            row = {name: column[i] for name, column in values.items()}
            row_id = int(ids[i])
            augment = None
            if epoch is not None:
                augment = np.random.default_rng([self.seed, epoch, row_id])
            try:
                if self.decode_fn is not None:
                    decoded = self.decode_fn(row, augment)
                else:
                    decoded = _default(row, self.kinds)
            except Exception as e:
                self._check_labels_read(e, row)
                name = names[i] if names is not None else _origin(row)
                error = self._bad_row(e, row_id, name)
                if self.spec.bad_rows == "fail":
                    raise error from e
                log.warning("%s; skipped (bad_rows='skip')", error)
                out.append(None)
                continue
            if self.decode_fn is not None:
                if self.fit_labels and isinstance(decoded, dict):  # transform: labels unused
                    decoded = {
                        k: v for k, v in decoded.items() if k in row or k not in self.fit_labels
                    }
                _check_decoded(decoded, row, row_id, self.collate_fn is not None)
            out.append(decoded)
        return out

    def _check_labels_read(self, error: Exception, row: dict) -> None:
        """In transform, a decode_fn that failed reading one of the fit's label columns
        (a KeyError): not a bad row, so said as it is."""
        if self.fit_labels is None or self.decode_fn is None or not isinstance(error, KeyError):
            return
        name = error.args[0] if error.args else None
        if name in self.fit_labels and name not in row:
            raise KeyError(
                f"decode_fn: read '{name}', a label column of the fit; transform's rows hold "
                f"only the variable feature columns ({', '.join(sorted(row))}): read a label "
                f"only where the row has it (if '{name}' in row: ...)"
            ) from error

    def _bad_row(self, error: Exception, row_id: int, name: str | None) -> BadRow:
        where = getattr(error, "column", None)
        if where is not None:
            role = "label" if where in self.labels else "feature"
            param = f"{column_param(role)}: column '{where}'"
        else:
            param = "decode_fn"
        named = f" ({self.row_names or 'origin'} {name})" if name else ""
        cause = error.__cause__ if where is not None and error.__cause__ else error
        if self.fit_labels is not None:  # transform: no bad_rows, the rows are the caller's
            return BadRow(
                f"{param}: row {row_id} of the batch{named} could not be decoded "
                f"({type(cause).__name__}: {cause}); fix it, or filter such rows out of the "
                "DataFrame before transform"
            )
        return BadRow(
            f"{param}: row {row_id} of the split{named} could not be decoded "
            f"({type(cause).__name__}: {cause}); fix or filter it, or set bad_rows='skip' to "
            "leave such rows out (counted in the training summary)"
        )

    def on_device(self, decoded: Decoded, device: torch.device) -> None:
        """With ``decode_device="cuda"``: the encoded images, still bytes after the rows'
        decoding, decoded on ``device`` in one call per column (``decode_jpegs``)."""
        for name, kind in self.kinds.items():
            if kind == "bytes" and isinstance(decoded.columns.get(name), list):
                decoded.columns[name] = decode_jpegs(name, decoded.columns[name], device)

    def collate(self, rows: list[dict]) -> Decoded:
        """The decoded rows as one batch: ``collate_fn``'s, or ``collate``."""
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
            column = [row[c.name] for row in rows]
            label = c.name in self.labels
            columns[c.name], mask = self._collate_column(c.name, column, label)
            if mask is not None and not label:
                masks[c.name] = mask
        return Decoded(columns, masks, len(rows))

    def _collate_column(self, name: str, values: list, label: bool):
        """One column's rows: tensors of one shape stacked; 1-D tensors (sequences) padded
        to the longest, with their mask; strings and other objects as a list."""
        if not values or not all(isinstance(v, torch.Tensor) for v in values):
            if values and all(isinstance(v, (int, float)) for v in values):
                return torch.tensor(values), None
            return values, None
        if all(v.dim() == 1 for v in values):
            integral = not values[0].is_floating_point()
            fill = LABEL_PADDING if label and integral else self.spec.padding_value
            padded, mask = pad_sequences(values, fill)
            self.padding[0] += int(mask.sum())
            self.padding[1] += mask.numel()
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
            raise ValueError(
                f"{column_param(role)}: column '{name}' has rows of different shapes in one "
                f"batch ({'x'.join(map(str, a))} and {'x'.join(map(str, b))}); give decode_fn "
                "that resizes or crops them to one size (spark_estimator.decoding.decode_image "
                "with size=, center_crop, random_crop), or a collate_fn"
            )
        return torch.stack(values), None


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


def decode_jpegs(name: str, images: list[bytes], device: torch.device) -> torch.Tensor:
    """JPEG images decoded on ``device`` (a GPU) in one batch by torchvision's
    ``decode_jpeg``, as uint8 ``[rows, 3, H, W]`` (RGB)."""
    decode_jpeg, ImageReadMode = require_gpu_jpeg()
    data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in images]
    if not data:
        return torch.empty((0, 3, 0, 0), dtype=torch.uint8, device=device)
    out = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    shapes = sorted({tuple(t.shape) for t in out})
    if len(shapes) > 1:
        a, b = shapes[:2]
        raise ValueError(
            f"feature_cols: column '{name}' has images of different sizes in one batch "
            f"({'x'.join(map(str, a))} and {'x'.join(map(str, b))}); decode_device='cuda' "
            "stacks them as they are: resize them to one size before fit"
        )
    return torch.stack(out)


class _ColumnFailed(ValueError):
    """The default decoding of one column raised (its name in ``column``)."""

    def __init__(self, column: str):
        super().__init__(column)
        self.column = column


def _default(row: dict, kinds: dict[str, str]) -> dict:
    """``default_decode`` column by column, so a failure names its column."""
    out = {}
    for name, value in row.items():
        try:
            out.update(default_decode({name: value}, kinds))
        except Exception as e:
            raise _ColumnFailed(name) from e
    return out


def _origin(row: dict) -> str | None:
    """An image struct's ``origin`` (its file), the name of a row without ``row_names``."""
    for value in row.values():
        if isinstance(value, dict) and value.get("origin"):
            return value["origin"]
    return None


def _check_decoded(decoded, row: dict, row_id: int, collated: bool) -> None:
    """A decode_fn's result: a dict with a value for each column of ``row``; without a
    collate_fn (``collated``), none of them a list, tuple or NumPy array, which would reach
    forward() as a list of rows."""
    if not isinstance(decoded, dict) or set(decoded) != set(row):
        got = sorted(decoded) if isinstance(decoded, dict) else type(decoded).__name__
        raise TypeError(
            f"decode_fn: must return a dict with a value for each of {sorted(row)}, got {got}"
        )
    if collated:
        return
    for name, value in decoded.items():
        if isinstance(value, (list, tuple, np.ndarray)):
            raise TypeError(
                f"decode_fn: returned a {type(value).__name__} of {len(value)} values for "
                f"column '{name}' of row {row_id}; return a tensor (torch.tensor(...), "
                "torch.from_numpy(...)), which a batch stacks or pads, or give a collate_fn "
                "that batches these values"
            )
