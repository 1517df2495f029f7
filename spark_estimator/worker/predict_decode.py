"""Executor: the variable columns of ``transform``'s Arrow batches decoded as a fit decodes
them (``Decoder``: threads or worker processes, no augmentation).

Spark's Python worker runs one task after another, and ``transform`` one task per
partition: the decoder (and its worker processes) of a model's decoding is made once per
Python worker and kept for the next tasks (``decoder_for``): a task holds it until it lets
it go (``release``), however long it decodes, and it is closed once no task has held it for
``IDLE_S`` seconds, at once after a task that did not finish with it, or with the Python
worker (its decode workers end with it).
Each Arrow batch (``spark.sql.execution.arrow.maxRecordsPerBatch`` rows, 10,000 by default)
is decoded in parts of ``PART_ROWS`` rows, several in flight at once with worker
processes, and the parts joined again (``join_parts``: padded sequences padded to the
longest part's), so that the model still runs on the whole Arrow batch.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import pyarrow as pa
import torch

from ..shared.spec import ColumnSpec, DecodeSpec
from .data.arrow_reader import ROW_ID
from .data.convert import variable_rows
from .decode.decoded import Decoded
from .decode.decoder import Decoder

PART_ROWS = 256  # rows of an Arrow batch decoded together (one worker's message)
IDLE_S = 60.0  # a kept decoder that no task holds is closed after this long


@dataclass
class _Kept:
    """A kept decoder: its decoding's ``key``, the tasks holding it (``decoder_for`` to
    ``release``), when the last let it go, and whether it is ``retired`` (a task using it
    did not finish: it is closed once let go, never handed out again)."""

    key: str
    decoder: Decoder
    users: int = 0
    idle_since: float = 0.0
    retired: bool = False


_kept: list[_Kept] = []
_changed = threading.Condition()  # guards _kept; notified when a decoder is let go
_reaper: threading.Thread | None = None


def decoder_for(
    spec: DecodeSpec,
    features: list[ColumnSpec],
    row_names: str | None,
    fit_labels: list[str],
    task: str,
    pin: bool,
) -> Decoder:
    """This Python worker's decoder for a model's decoding (made on first use, then kept),
    held by the task until it calls ``release``; ``task`` names the task in errors."""
    key = hashlib.sha256(repr((spec, features, row_names, fit_labels, pin)).encode()).hexdigest()
    with _changed:
        kept = next((k for k in _kept if k.key == key and not k.retired), None)
        if kept is None:
            device = torch.device("cuda") if pin else None
            decoder = Decoder(
                spec, features, set(), 0, row_names, fit_labels, task, device, PART_ROWS
            )
            kept = _Kept(key, decoder)
            _kept.append(kept)
        kept.users += 1
    decoder = kept.decoder
    decoder.rank = task
    return decoder


def release(decoder: Decoder, finished: bool) -> None:
    """A task is done with ``decoder``: once no task holds it, its idle time starts. A
    task that did not finish (an error, or its output not read to the end) may leave it
    closed or mid-pass: it is closed once let go, and the next task gets a new one."""
    global _reaper
    with _changed:
        for kept in _kept:
            if kept.decoder is decoder:
                kept.users -= 1
                kept.idle_since = time.monotonic()
                kept.retired = kept.retired or not finished
        if _reaper is None or not _reaper.is_alive():
            _reaper = threading.Thread(target=_reap, name="spark-estimator-decoders", daemon=True)
            _reaper.start()
        _changed.notify()


def _reap() -> None:
    """Close each kept decoder that no task holds once retired or after ``IDLE_S``
    seconds, waking when the first is due or a decoder is let go."""
    while True:
        with _changed:
            now = time.monotonic()
            idle = [k for k in _kept if not k.users]
            due = [k for k in idle if k.retired or now - k.idle_since >= IDLE_S]
            for kept in due:
                _kept.remove(kept)
            if not due:
                waits = [k.idle_since + IDLE_S - now for k in idle]
                _changed.wait(min(waits) if waits else None)
        for kept in due:
            kept.decoder.close()


def decoded_batches(
    batches: Iterable[pa.RecordBatch],
    features: list[ColumnSpec],
    row_names: str | None,
    decoder: Decoder,
) -> Iterator[tuple[pa.RecordBatch, Decoded]]:
    """Each Arrow batch with rows, and its variable feature columns decoded (see the
    module)."""
    variable = [c for c in features if c.variable]
    pending: dict[int, tuple[pa.RecordBatch, int]] = {}  # batch index -> (batch, its parts)

    def raws_of(batch: pa.RecordBatch) -> dict:
        raws = {c.name: variable_rows(c, batch.column(c.name), "transform") for c in variable}
        if row_names:
            raws[row_names] = batch.column(row_names).to_numpy(zero_copy_only=False)
        return raws

    with_rows = (batch for batch in batches if batch.num_rows)
    first = next(with_rows, None)
    if first is None:
        return
    first_raws = raws_of(first)
    if not decoder.primed:  # on this Python worker's first batch with rows
        decoder.prime({name: values[:1] for name, values in first_raws.items()})

    def parts() -> Iterator[tuple[int, dict]]:
        for index, batch in enumerate(itertools.chain([first], with_rows)):
            raws = first_raws if index == 0 else raws_of(batch)
            starts = range(0, batch.num_rows, PART_ROWS)
            pending[index] = (batch, len(starts))
            for start in starts:
                part = {n: v[start : start + PART_ROWS] for n, v in raws.items()}
                part["_offset"] = start
                yield index, part

    done: list[Decoded] = []
    for (index, _part), (decoded, _) in decoder.ahead(parts(), None, lambda item: _rows(item[1])):
        done.append(decoded)
        batch, count = pending[index]
        if len(done) == count:
            del pending[index]
            joined = join_parts(done, decoder.spec.padding_value)
            done = []
            yield batch, joined


def _rows(part: dict) -> dict:
    """A part's raw values, its rows numbered from the Arrow batch's first (as errors
    name them)."""
    values = {n: v for n, v in part.items() if n != "_offset"}
    rows = len(next(iter(values.values())))
    return {**values, ROW_ID: torch.arange(part["_offset"], part["_offset"] + rows)}


def join_parts(parts: list[Decoded], padding_value: float) -> Decoded:
    """Decoded parts of one batch as one: tensors joined along the rows (a padded sequence
    and its mask padded to the longest part's first), lists joined."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    columns, masks = {}, {}
    for name, value in first.columns.items():
        values = [p.columns[name] for p in parts]
        if not isinstance(value, torch.Tensor):
            columns[name] = [v for part in values for v in part]
            continue
        fill = padding_value if name in first.masks else 0
        columns[name] = _cat(values, fill)
    for name in first.masks:
        masks[name] = _cat([p.masks[name] for p in parts], False)
    return Decoded(columns, masks, sum(p.rows for p in parts))


def _cat(tensors: list[torch.Tensor], fill) -> torch.Tensor:
    """Tensors joined on their first dimension, those of fewer positions on the second
    (sequences) padded with ``fill`` to the longest; into pinned memory where they are
    pinned (decoded for a GPU: the join is then copied to it without a staging copy),
    channels-last images as channels-last."""
    if tensors[0].dim() >= 2 and len({t.shape[1] for t in tensors}) > 1:
        longest = max(t.shape[1] for t in tensors)
        tensors = [
            torch.nn.functional.pad(t, (0, longest - t.shape[1]), value=fill) if t.dim() == 2 else t
            for t in tensors
        ]
    first = tensors[0]
    if not first.is_pinned():
        return torch.cat(tensors)
    rows = sum(len(t) for t in tensors)
    if first.dim() == 4 and not first.is_contiguous() and _channels_last(first):
        height, width, channels = first.shape[2], first.shape[3], first.shape[1]
        out = torch.empty((rows, height, width, channels), dtype=first.dtype, pin_memory=True)
        out = out.permute(0, 3, 1, 2)
    else:
        out = torch.empty((rows, *first.shape[1:]), dtype=first.dtype, pin_memory=True)
    return torch.cat(tensors, out=out)


def _channels_last(tensor: torch.Tensor) -> bool:
    return tensor.is_contiguous(memory_format=torch.channels_last)
