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
had. A row whose decoding raises fails the batch naming the column (or ``decode_fn`` and
the columns it was given), the row's index and name (binaryFile's ``path``, an image's
``origin``) with ``bad_rows="fail"``; with ``"skip"`` it is left out and reported
(``BatchResult.skipped``). In ``transform`` (``fit_labels`` given) a row holds the variable
feature columns only: a ``decode_fn`` that reads one of the fit's label columns is told so,
one that returns them anyway has them dropped, and a bad row is named with what to filter.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ...decoding import BadImage, default_decode, image_sizes
from ...decoding.batch import decode_images_into
from ...shared.serialization import loads
from ...shared.spec import column_param
from .collate import Allocate, Collation, different_shapes
from .decoded import MASK, BadRow, BatchResult, Decoded, Recipe
from .row_generators import row_generators

log = logging.getLogger("spark_estimator.worker.decode")
IN_WORKER_PROCESS = False  # set by a decode worker process (``worker_process``)
CUDA_HINT = (
    "decode workers are processes without a GPU: decode with decode_pool='threads' (in the "
    "training process, on its GPU), or decode_device='cuda' with decode_batch_fn"
)


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
        self.collation = Collation(self.columns, self.labels, spec.padding_value, self.collate_fn)
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
            tensor, found, positions = self._images(name, values[name], ids, names, bad, pool)
            whole[name] = (tensor, positions)
            bad |= found
        kept = [i for i in range(rows) if i not in bad]
        skipped = [(epoch is None, int(ids[i])) for i in sorted(bad)]
        padding = [0, 0]
        collated = None
        if kept:
            rows_kept = [decoded[i] for i in kept]
            collated = self.collation.rows(rows_kept, padding, set(images), self.allocate)
            for name, (tensor, positions) in whole.items():
                collated.columns[name] = _rows_kept(tensor, positions, kept)
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

    def _images(self, name: str, column, ids, names, bad: set[int], pool):
        """Image column ``name``'s rows but ``bad`` decoded as one batch into one buffer
        (``decode_images``: uint8 ``[B, 3, H, W]``, channels-last; in a worker's slot where
        it has room; split over the ``pool``'s threads), the rows among them that do not
        decode (each raised or left out as ``bad_rows`` says, having cost its own decoding
        attempts alone), and the rows it holds."""
        positions = [i for i in range(len(column)) if i not in bad]
        good = [column[i] for i in positions]
        height, width = _first_size(good)
        shape = (len(good), height, width, 3)
        out = self.allocate(shape, torch.uint8) if self.allocate is not None else None
        if out is None:
            out = torch.empty(shape, dtype=torch.uint8)
        spans = [(0, len(good))] if pool is None else _spans(len(good), pool._max_workers)

        def part(span: tuple[int, int]) -> dict[int, BadImage]:
            start, stop = span
            errors = decode_images_into(good[start:stop], out[start:stop])
            return {start + i: error for i, error in errors.items()}

        threaded = pool is not None and len(spans) > 1
        try:
            parts = pool.map(part, spans) if threaded else map(part, spans)
            errors = {i: error for found in parts for i, error in found.items()}
        except BadImage:
            raise
        except ValueError as e:  # images of different sizes
            raise self._different_sizes(name, good) from e
        found = set()
        for j, error in sorted(errors.items()):
            i = positions[j]
            failed = _ColumnFailed(name)
            failed.__cause__ = error.__cause__ or error
            row_name = names[i] if names is not None else None
            self._failed(failed, {name: column[i]}, int(ids[i]), row_name)
            found.add(i)
        return out.permute(0, 3, 1, 2), found, positions

    def _different_sizes(self, name: str, images: list) -> ValueError:
        try:
            shapes = sorted({(3, *size) for size in image_sizes(images)})[:2]
        except BadImage:
            shapes = []
        return different_shapes(name, "feature", shapes)

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
        bad = self._bad_row(error, row_id, name if name is not None else _origin(row), row)
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
                f"decode_batch_fn: failed on {_given_columns(batch)} of the batch whose first "
                "row is "
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
                columns[name], mask = self.collation.column(
                    name, list(value), name in self.labels, padding, self.allocate
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

    def _bad_row(self, error: Exception, row_id: int, name: str | None, row: Mapping) -> BadRow:
        """What a row that failed to decode says: the column that failed (default
        decoding) or the ``decode_fn`` and the columns ``row`` gave it, the row's index
        and name, the cause and the way out."""
        where = getattr(error, "column", None)
        if where is not None:
            role = "label" if where in self.labels else "feature"
            param, given = f"{column_param(role)}: column '{where}'", ""
        else:
            param, given = "decode_fn", f" from {_given_columns(row)}"
        named = f" ({self.row_names or 'origin'} {name})" if name else ""
        cause = error.__cause__ if where is not None and error.__cause__ else error
        if self.fit_labels is not None:  # transform: no bad_rows, the rows are the caller's
            return BadRow(
                f"{param}: row {row_id} of the batch{named} could not be decoded{given} "
                f"({type(cause).__name__}: {cause}); fix it, or filter such rows out of the "
                "DataFrame before transform"
            )
        return BadRow(
            f"{param}: row {row_id} of the split{named} could not be decoded{given} "
            f"({type(cause).__name__}: {cause}); fix or filter it, or set bad_rows='skip' to "
            "leave such rows out (counted in the training summary)"
        )


def _first_size(images: list) -> tuple[int, int]:
    """The (height, width) of the first of ``images`` whose header reads ((1, 1) where none
    does: every image then fails to decode, and is named)."""
    for image in images:
        try:
            return image_sizes([image])[0]
        except BadImage:
            continue
    return 1, 1


def _rows_kept(batch: torch.Tensor, positions: list[int], kept: list[int]) -> torch.Tensor:
    """An image batch ``[B, C, H, W]`` (a channels-last view of its pixels) decoded for the
    rows ``positions``, cut down to the rows ``kept`` (some of them) in its own memory: its
    first rows."""
    if positions == kept:
        return batch
    where = {row: j for j, row in enumerate(positions)}
    pixels = batch.permute(0, 2, 3, 1)  # the [B, H, W, C] buffer
    pixels[: len(kept)] = pixels[torch.tensor([where[i] for i in kept], dtype=torch.long)]
    return batch[: len(kept)]


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


def _given_columns(row: Mapping) -> str:
    """The columns a user's decoding function was given, as its errors name them."""
    names = ", ".join(f"'{name}'" for name in row)
    return f"column {names}" if len(row) == 1 else f"columns {names}"


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
