"""Executor: one batch's variable columns decoded and collated into tensors, the same in a
rank's threads and in its decode worker processes (``decode_pool``).

``BatchDecoding`` holds what decoding needs (the user's functions, the columns and their
kinds, the seed) and turns a batch's raw values (NumPy arrays of Python objects: bytes,
strings, image dicts, 1-D arrays; the rows' indices in their split; their names) into a
``Decoded`` batch, as a PyTorch ``Dataset``'s ``__getitem__`` and a ``DataLoader``'s
``collate_fn`` would: each row through ``decode_fn(row, augment)`` (``default_decode``
without one), or the whole batch through ``decode_batch_fn(rows, augments)``, then
``collate_fn`` (``collate`` without one: tensors of one shape stacked, 1-D tensors padded
with their mask, other values listed).

``augment`` is a NumPy generator seeded by (seed, epoch, the row's index in its split) when
training (``np.random.default_rng([seed, epoch, row])``, made a batch at a time by
``row_generators``), None otherwise: a row's transforms are the same whenever, on whichever
rank and by whichever worker it is decoded, so results do not depend on how many workers
decode, and an exact resume or an elastic resize sees each row with the transforms it would have
had. A row whose decoding raises fails the batch naming the column (or ``decode_fn``), the
row's index and name (binaryFile's ``path``, an image's ``origin``) with
``bad_rows="fail"``; with ``"skip"`` it is left out and reported (``BatchResult.skipped``).
In ``transform`` (``fit_labels`` given) a row holds the variable feature columns only: a
``decode_fn`` that reads one of the fit's label columns is told so, one that returns them
anyway has them dropped, and a bad row is named with what to filter.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...decoding import (
    BadImage,
    _channels_innermost,
    decode_images,
    default_decode,
    image_sizes,
)
from ...shared.serialization import loads
from ...shared.spec import ColumnSpec, DecodeSpec, column_param
from .row_generators import row_generators

log = logging.getLogger("spark_estimator.worker.data.decode")
LABEL_PADDING = -100  # integer sequence labels: the index CrossEntropyLoss ignores
MASK = "_mask"  # the suffix of a padded column's mask in a collated batch
IN_WORKER_PROCESS = False  # set by a decode worker process (``decode_worker``)
CUDA_HINT = (
    "decode workers are processes without a GPU: decode with decode_pool='threads' (in the "
    "training process, on its GPU), or decode_device='cuda' with decode_batch_fn"
)

# (shape, dtype) -> a contiguous CPU tensor to stack a batch's rows into, or None
Allocate = Callable[[tuple[int, ...], torch.dtype], "torch.Tensor | None"]


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
        """Zero rows of each column, as decoded."""
        columns = {n: v[:0] for n, v in self.columns.items()}
        return Decoded(columns, {n: m[:0] for n, m in self.masks.items()}, 0)


@dataclass
class BatchResult:
    """What decoding one batch gives: the batch (None when no row was kept), the positions
    of the rows kept (None: all), the rows left out as (validation?, row index), and the
    values of the padded sequences collated: [their own, with the padding]."""

    decoded: Decoded | None
    kept: np.ndarray | None = None
    skipped: list[tuple[bool, int]] = field(default_factory=list)
    padding: list[int] = field(default_factory=lambda: [0, 0])


@dataclass(frozen=True)
class Recipe:
    """What a ``BatchDecoding`` is made from (picklable: a decode worker process gets it)."""

    spec: DecodeSpec
    columns: tuple[ColumnSpec, ...]  # the variable columns decoded
    labels: frozenset[str]  # which of them are labels
    seed: int
    row_names: str | None = None  # the column naming each row (``path``)
    fit_labels: tuple[str, ...] | None = None  # transform: the fit's label columns


class BatchDecoding:
    """Decodes and collates batches of ``recipe``'s columns (see the module)."""

    def __init__(self, recipe: Recipe):
        self.recipe, spec = recipe, recipe.spec
        self.seed, self.row_names, self.labels = recipe.seed, recipe.row_names, recipe.labels
        self.fit_labels = recipe.fit_labels
        self.columns = list(recipe.columns)
        self.kinds = {c.name: c.kind for c in self.columns}
        if spec.device == "cuda":  # encoded images are decoded on the GPU, per batch
            self.kinds = {n: ("bytes" if k == "binary" else k) for n, k in self.kinds.items()}
        functions = loads(spec.functions) if spec.functions else {}
        self.decode_fn: Callable | None = functions.get("decode_fn")
        self.batch_fn: Callable | None = functions.get("decode_batch_fn")
        self.collate_fn: Callable | None = functions.get("collate_fn")
        self.init_fn: Callable | None = functions.get("decode_init_fn")
        self.initialized = False
        self.allocate: Allocate | None = None  # a decode worker's: where stacked batches go

    def init(self) -> None:
        """``decode_init_fn``, once, before the first batch (in each worker process)."""
        if not self.initialized:
            self.initialized = True
            if self.init_fn is not None:
                self.init_fn()

    def decode(
        self,
        values: Mapping[str, np.ndarray],
        ids: np.ndarray,
        names: np.ndarray | None,
        epoch: int | None,
        pool: ThreadPoolExecutor | None = None,
    ) -> BatchResult:
        """The batch of raw ``values`` (column -> one object per row) with row indices
        ``ids`` and row ``names`` decoded (``epoch``: None when not training, so without
        augmentation) and collated; with a thread ``pool``, its rows in ranges spread over
        the pool's threads."""
        self.init()
        rows = len(ids)
        if self.batch_fn is not None:
            return self.decode_batch(values, ids, names, epoch)
        images = self._batch_images()
        per_row = {name: column for name, column in values.items() if name not in images}
        decoded: list[dict | None] = [{} for _ in range(rows)]
        if per_row:
            spans = [(0, rows)] if pool is None else _spans(rows, pool._max_workers)
            work = [(per_row, ids, names, epoch, start, stop) for start, stop in spans]
            parts = pool.map(self._decode_rows, work) if pool else map(self._decode_rows, work)
            decoded = [row for part in parts for row in part]
        bad = {i for i, row in enumerate(decoded) if row is None}
        whole = {}  # image column -> (its batch decoded, the rows it holds)
        for name in images:
            tensor, found, positions = self._images(name, values[name], ids, names, bad)
            whole[name] = (tensor, positions)
            bad |= found
        kept = [i for i in range(rows) if i not in bad]
        skipped = [(epoch is None, int(ids[i])) for i in sorted(bad)]
        padding = [0, 0]
        collated = None
        if kept:
            collated = self.collate([decoded[i] for i in kept], padding, skip=set(images))
            for name, (tensor, positions) in whole.items():
                if tensor is None or positions != kept:  # rows left out since: decode again
                    tensor = decode_images([values[name][i] for i in kept])
                collated.columns[name] = tensor
            if whole:  # the columns in their order
                collated.columns = {c.name: collated.columns[c.name] for c in self.columns}
        kept_rows = None if len(kept) == rows else np.asarray(kept, dtype=np.int64)
        return BatchResult(collated, kept_rows, skipped, padding)

    def _batch_images(self) -> list[str]:
        """The columns of encoded images decoded a batch at a time (``decode_images``): all
        of them without a decode_fn or collate_fn (which take rows)."""
        if self.decode_fn is not None or self.collate_fn is not None:
            return []
        return [c.name for c in self.columns if self.kinds[c.name] == "binary"]

    def _images(self, name: str, column, ids, names, bad: set[int]):
        """Image column ``name``'s rows but ``bad`` decoded as one batch (``decode_images``:
        uint8 ``[B, 3, H, W]``, channels-last), the rows among them that do not decode, and
        the rows it holds. Where one does not decode, each image is tried alone, and each
        that fails is raised or left out as ``bad_rows`` says (the batch then None)."""
        positions = [i for i in range(len(column)) if i not in bad]
        good = [column[i] for i in positions]
        try:
            return decode_images(good), set(), positions
        except BadImage:
            pass
        except ValueError as e:  # images of different sizes
            raise self._different_sizes(name, good) from e
        found = set()
        for i in positions:
            try:
                decode_images([column[i]])
            except BadImage as e:
                error = _ColumnFailed(name)
                error.__cause__ = e.__cause__ or e
                row_name = names[i] if names is not None else None
                self._failed(error, {name: column[i]}, int(ids[i]), row_name)
                found.add(i)
        return None, found, positions

    def _different_sizes(self, name: str, images: list) -> ValueError:
        try:
            shapes = sorted({(3, *size) for size in image_sizes(images)})[:2]
        except BadImage:
            shapes = []
        return _different_shapes(name, "feature", shapes)

    def _decode_rows(self, work) -> list[dict | None]:
        values, ids, names, epoch, start, stop = work
        out = []
        augments = None if epoch is None else row_generators(self.seed, epoch, ids[start:stop])
        for i in range(start, stop):
            row = {name: column[i] for name, column in values.items()}
            row_id = int(ids[i])
            augment = None if augments is None else augments[i - start]
            try:
                if self.decode_fn is not None:
                    decoded = self.decode_fn(row, augment)
                else:
                    decoded = _default(row, self.kinds)
            except Exception as e:
                self._check_labels_read(e, row)
                _check_cuda(e, "decode_fn")
                self._failed(e, row, row_id, names[i] if names is not None else None)
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

    def _failed(self, error: Exception, row: dict, row_id: int, name) -> None:
        """A row that failed to decode: raised as a ``BadRow`` (``bad_rows="fail"``) or
        warned of (``"skip"``)."""
        bad = self._bad_row(error, row_id, name if name is not None else _origin(row))
        if self.recipe.spec.bad_rows == "fail":
            raise bad from error
        log.warning("%s; skipped (bad_rows='skip')", bad)

    def decode_batch(self, values, ids, names, epoch: int | None) -> BatchResult:
        """``decode_batch_fn`` on the whole batch (a column of values, or of images already
        decoded on the GPU as one tensor); its result collated as rows would be."""
        self.init()
        rows = len(ids)
        batch = {
            name: column if isinstance(column, torch.Tensor) else list(column)
            for name, column in values.items()
        }
        augments = None if epoch is None else row_generators(self.seed, epoch, ids)
        try:
            out = self.batch_fn(batch, augments)
        except Exception as e:
            self._check_labels_read(e, batch, "decode_batch_fn")
            _check_cuda(e, "decode_batch_fn")
            first = f" ({self.row_names} {names[0]})" if names is not None and rows else ""
            raise BadRow(
                f"decode_batch_fn: failed on the batch whose first row is "
                f"{int(ids[0]) if rows else '-'} of the split{first} "
                f"({type(e).__name__}: {e}); bad_rows leaves out rows of decode_fn only"
            ) from e
        if not isinstance(out, dict):
            raise TypeError(
                f"decode_batch_fn: must return a dict of column -> tensor, got {type(out).__name__}"
            )
        if self.fit_labels:
            out = {k: v for k, v in out.items() if k in batch or k not in self.fit_labels}
        padding = [0, 0]
        columns, masks = {}, {}
        for name, value in out.items():
            if name.endswith(MASK):
                masks[name[: -len(MASK)]] = value
                continue
            if isinstance(value, torch.Tensor):
                columns[name] = value
            else:
                columns[name], mask = self._collate_column(
                    name, list(value), name in self.labels, padding
                )
                if mask is not None and name not in self.labels:
                    masks.setdefault(name, mask)
        missing = sorted(set(batch) - set(columns))
        if missing:
            raise TypeError(
                f"decode_batch_fn: must return a value for each of {sorted(batch)}, "
                f"missing {missing}"
            )
        for name, value in columns.items():
            if len(value) != rows:
                raise ValueError(
                    f"decode_batch_fn: column '{name}' has {len(value)} rows for a batch of "
                    f"{rows}; it must return one per row"
                )
        return BatchResult(Decoded(columns, masks, rows), None, [], padding)

    def _check_labels_read(self, error: Exception, row: Mapping, fn: str = "decode_fn") -> None:
        """In transform, a decode_fn that failed reading one of the fit's label columns
        (a KeyError): not a bad row, so said as it is."""
        user_fn = self.decode_fn if fn == "decode_fn" else self.batch_fn
        if self.fit_labels is None or user_fn is None or not isinstance(error, KeyError):
            return
        name = error.args[0] if error.args else None
        if name in self.fit_labels and name not in row:
            raise KeyError(
                f"{fn}: read '{name}', a label column of the fit; transform's rows hold "
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

    def collate(
        self, rows: list[dict], padding: list[int], skip: set[str] = frozenset()
    ) -> Decoded:
        """The decoded rows as one batch: ``collate_fn``'s, or ``collate``; the values of
        padded sequences added to ``padding``; the columns ``skip`` left out (decoded a
        batch at a time)."""
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
            column = [row[c.name] for row in rows]
            label = c.name in self.labels
            columns[c.name], mask = self._collate_column(c.name, column, label, padding)
            if mask is not None and not label:
                masks[c.name] = mask
        return Decoded(columns, masks, len(rows))

    def _collate_column(self, name: str, values: list, label: bool, padding: list[int]):
        """One column's rows: tensors of one shape stacked; 1-D tensors (sequences) padded
        to the longest, with their mask; strings and other objects as a list."""
        if not values or not all(isinstance(v, torch.Tensor) for v in values):
            if values and all(isinstance(v, (int, float)) for v in values):
                return torch.tensor(values), None
            return values, None
        if all(v.dim() == 1 for v in values):
            integral = not values[0].is_floating_point()
            fill = LABEL_PADDING if label and integral else self.recipe.spec.padding_value
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
            raise _different_shapes(name, role, [a, b])
        return stack_rows(values, self.allocate), None


def _different_shapes(name: str, role: str, shapes: list[tuple[int, ...]]) -> ValueError:
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


def _spans(rows: int, parallel: int) -> list[tuple[int, int]]:
    """Contiguous row ranges, one per thread at most, not below 8 rows each."""
    parts = max(1, min(parallel, -(-rows // 8)))
    bounds = np.linspace(0, rows, parts + 1).astype(int)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


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


def _check_cuda(error: Exception, fn: str) -> None:
    """A user's function that failed for want of CUDA in a decode worker process (whose
    CUDA_VISIBLE_DEVICES is empty): said as it is, not as a bad row."""
    cuda = isinstance(error, (RuntimeError, AssertionError)) and "CUDA" in str(error)
    if IN_WORKER_PROCESS and cuda:
        message = f"{fn}: uses CUDA ({type(error).__name__}: {error}); {CUDA_HINT}"
        raise RuntimeError(message) from error


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
