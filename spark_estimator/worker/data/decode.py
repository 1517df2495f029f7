"""Executor: a rank's decoding of its batches' variable columns, in threads or in worker
processes (``decode_pool``), and with ``decode_device="cuda"`` on its GPU.

The loader hands over batches whose variable columns (encoded images, Spark's image
structs, strings, arrays of varying length) are arrays of Python objects, in the rows'
seeded order. ``Decoder`` turns them into tensors with a ``BatchDecoding`` (the per-row
``decode_fn``, or ``decode_batch_fn``, and collation: see ``decode_batch``), in one of two
ways, whose results are the same, bit for bit:

- ``threads``: in the rank's own process, each batch's rows spread over ``workers`` threads
  (Pillow and tokenizers release the GIL while they work; Python in a ``decode_fn`` does
  not, and the training thread waits for the same GIL);
- ``processes``: ``workers`` decode worker processes (``DecodePool``), each decoding whole
  batches into shared memory, several batches in flight (``ahead``).

``"auto"`` takes processes where the task has more than ``THREADS_UP_TO_CPUS`` CPUs (a
worker process costs seconds to start and its own interpreter's memory, which a task of
one or two CPUs does not win back), and threads where shared memory is too small for the
workers' batches (said once, as a warning). ``prime`` decodes a split's first rows in the
rank, to know the columns' decoded shapes (a batch without rows then gets zero rows of
each) and how large a batch is. The rank keeps what decoding reported: the rows left out
(``bad_rows="skip"``, each counted once however many epochs skip it) and the padding.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import torch

from ...shared.packages import require_gpu_jpeg
from ...shared.spec import ColumnSpec, DecodeSpec
from .arrow_reader import ROW_ID
from .decode_batch import MASK, BadRow, BatchDecoding, BatchResult, Decoded, Recipe
from .decode_channel import SHM_DIR_ENV, shm_dir, shm_free_bytes
from .decode_pool import DecodePool
from .decode_worker import SLOTS

__all__ = ["MASK", "BadRow", "Decoded", "Decoder", "decode_jpegs"]

log = logging.getLogger(__name__)
T = TypeVar("T")
THREADS_UP_TO_CPUS = 2  # decode_pool="auto": threads for tasks of this many CPUs or fewer
SHM_SHARE = 0.8  # the most of the free shared memory the workers' slots may plan to take


def task_cpus() -> int:
    """The CPUs this task may use (torch's intra-op threads are set to its share of the
    executor's cores)."""
    return max(1, min(torch.get_num_threads(), os.cpu_count() or 1))


def default_workers(pool: str, cpus: int) -> int:
    """Decode workers per rank: threads, the task's CPUs; processes, the CPUs less the
    training thread's and the batch thread's (at least one); none where the GPU decodes
    all."""
    if pool == "gpu":
        return 0
    return cpus if pool == "threads" else max(1, cpus - 2)


class Decoder:
    """Decodes and collates the variable ``columns`` of batches (see the module):
    ``labels`` are the label columns, ``seed`` seeds augmentation, ``row_names`` the
    column naming rows in errors, ``fit_labels`` (transform) the fit's label columns,
    ``rank`` names the rank in errors, ``pin`` copies batches from worker processes into
    pinned memory, ``batch_rows`` the usual rows of a batch (to size shared memory)."""

    def __init__(
        self,
        spec: DecodeSpec,
        columns: list[ColumnSpec],
        labels: set[str],
        seed: int,
        row_names: str | None = None,
        fit_labels: list[str] | None = None,
        rank: int | str = 0,
        pin: bool = False,
        batch_rows: int = 256,
    ):
        self.spec, self.row_names, self.rank, self.pin = spec, row_names, rank, pin
        self.batch_rows = batch_rows
        variable = tuple(c for c in columns if c.variable)
        fit = tuple(fit_labels) if fit_labels is not None else None

        def recipe(decoded: tuple[ColumnSpec, ...]) -> Recipe:
            return Recipe(spec, decoded, frozenset(labels), seed, row_names, fit)

        whole = BatchDecoding(recipe(variable))
        # decode_device="cuda": the binary columns' JPEGs are decoded on the GPU, a batch at
        # a time (on_device); they reach it as the rows' bytes, not through the workers
        gpu = spec.device == "cuda" and whole.collate_fn is None
        self.gpu_images = [c.name for c in variable if gpu and c.kind == "binary"]
        # with decode_batch_fn too, the whole batch is decoded here, after the GPU's part
        self.on_gpu = gpu and whole.batch_fn is not None
        cpu = () if self.on_gpu else tuple(c for c in variable if c.name not in self.gpu_images)
        self.recipe = recipe(cpu)
        self.local = BatchDecoding(self.recipe)  # the rank's own: threads, and priming
        self.columns = list(variable)
        cpus = task_cpus()
        self.kind = _pool_kind(spec.pool, cpus, bool(cpu))
        self.workers = default_workers(self.kind, cpus)
        if spec.workers and self.kind != "gpu":
            self.workers = spec.workers
        self.threads: ThreadPoolExecutor | None = None
        self.processes: DecodePool | None = None
        self.skipped_rows: set[tuple[bool, int]] = set()  # (validation?, row) left out
        self.padding = [0, 0]  # values of padded sequences: real, in all (with the padding)
        self.empty: Decoded | None = None  # zero rows of each column, as decoded (``prime``)
        self.note: str | None = None  # why processes were asked for and threads decode
        self.primed = False

    # -- set-up --------------------------------------------------------------------------------
    def prime(self, first: Mapping | None) -> None:
        """Start the decode workers, and decode ``first`` (a split's first rows, or None)
        once, not counted, for the decoded columns' shapes (and how much shared memory
        worker processes need for batches like it)."""
        self.primed = True
        self._start()
        if first is None:
            return
        try:
            ((_, (decoded, _)),) = self.ahead([first], None)
        except BaseException:
            self.close()
            raise
        self.skipped_rows, self.padding = set(), [0, 0]
        if decoded.rows:
            self.empty = decoded.empty()
            self._check_shared_memory(decoded)

    def _check_shared_memory(self, decoded: Decoded) -> None:
        """Worker processes decode into shared memory: where it cannot hold their slots for
        batches of ``batch_rows`` rows like ``decoded``'s, threads decode instead."""
        if self.processes is None:
            return
        tensors = decoded.tensors().values()
        row = sum(t.numel() * t.element_size() for t in tensors) / decoded.rows
        need = int(row * self.batch_rows * 1.25) * SLOTS * self.workers
        folder = shm_dir()
        free = shm_free_bytes(folder)
        if need <= free * SHM_SHARE:
            return
        self.processes.close()
        self.processes = None
        self.note = (
            f"decode_pool: worker processes decode into shared memory in {folder}, which "
            f"has {free / 2**20:.0f} MiB free, and {self.workers} of them need about "
            f"{need / 2**20:.0f} MiB ({SLOTS} batches of {self.batch_rows} rows each); "
            "decoding in threads instead, which is slower. Give the container more shared "
            "memory (docker run --shm-size=2g; on Kubernetes an emptyDir of medium Memory "
            f"mounted at /dev/shm), set {SHM_DIR_ENV} to a larger tmpfs, or lower "
            "decode_workers"
        )
        log.warning(self.note)
        self.kind = "threads"
        self.workers = self.spec.workers or default_workers("threads", task_cpus())
        self._start()

    def _start(self) -> None:
        if self.kind == "processes" and self.processes is None:
            self.processes = DecodePool(self.recipe, self.workers, self.rank, self.pin)
        elif self.kind == "threads" and self.threads is None and self.workers > 1:
            self.threads = ThreadPoolExecutor(
                self.workers, thread_name_prefix="spark-estimator-decode"
            )

    @property
    def skipped(self) -> int:
        """The rows left out (``bad_rows="skip"``), each counted once."""
        return len(self.skipped_rows)

    def summary(self) -> dict:
        """How this rank decoded, for its summary."""
        out = {"pool": self.kind, "workers": self.workers}
        if self.processes is not None:
            out["worker_peak_rss_bytes"] = self.processes.peak_rss()
        if self.note:
            out["note"] = self.note
        return out

    def close(self) -> None:
        if self.threads is not None:
            self.threads.shutdown(wait=False, cancel_futures=True)
        if self.processes is not None:
            self.processes.close()

    # -- decoding ------------------------------------------------------------------------------
    def __call__(self, batch: Mapping, epoch: int | None) -> tuple[Decoded, np.ndarray | None]:
        """One batch's variable columns decoded (``epoch``: None when not training, so
        without augmentation), and the positions of the rows kept (None: all of them)."""
        ((_, out),) = self.ahead([batch], epoch)
        return out

    def ahead(
        self,
        items: Iterable[T],
        epoch: int | None | Callable[[T], int | None],
        batch_of: Callable[[T], Mapping] = lambda b: b,
    ) -> Iterator[tuple[T, tuple[Decoded, np.ndarray | None]]]:
        """Each of ``items`` with its batch (``batch_of(item)``) decoded, in order: with
        worker processes several batches ahead, with threads one at a time as asked.
        ``epoch``: the epoch of every item, or a function giving an item's."""
        epoch_of = epoch if callable(epoch) else (lambda item: epoch)
        if self.processes is None:
            for item in items:
                batch = batch_of(item)
                result = self._decode_here(batch, epoch_of(item))
                yield item, self._finish(result, batch)
            return

        def raw(item: T):
            return (*self._raw(batch_of(item)), epoch_of(item))

        for item, result in self.processes.decode_many(items, raw):
            yield item, self._finish(result, batch_of(item))

    def _decode_here(self, batch: Mapping, epoch: int | None) -> BatchResult:
        values, ids, names = self._raw(batch)
        if not self.recipe.columns:  # all decoded on the GPU (on_device)
            return BatchResult(Decoded({}, {}, len(ids)))
        return self.local.decode(values, ids, names, epoch, self.threads)

    def _raw(self, batch: Mapping) -> tuple[dict, np.ndarray, np.ndarray | None]:
        """A batch's values of the columns decoded on the CPU, its row indices and names."""
        values = {c.name: batch[c.name] for c in self.recipe.columns}
        ids = self._ids(batch)
        names = batch[self.row_names] if self.row_names else None
        return values, ids, names

    def _ids(self, batch: Mapping) -> np.ndarray:
        if ROW_ID in batch:
            return batch[ROW_ID].numpy()
        rows = len(batch[self.columns[0].name]) if self.columns else 0
        return np.arange(rows)

    def _finish(self, result: BatchResult, batch: Mapping):
        """Count what ``result`` reports; its batch (zero rows of each column where none
        was kept), with the rows' bytes of the columns the GPU decodes, and the positions
        of the rows kept."""
        self.skipped_rows.update(tuple(s) for s in result.skipped)
        self.padding[0] += result.padding[0]
        self.padding[1] += result.padding[1]
        decoded, kept = result.decoded, result.kept
        if decoded is None:
            decoded = self.empty if self.empty is not None else Decoded({}, {}, 0)
            return decoded, kept
        raw = (
            self.columns if self.on_gpu else [c for c in self.columns if c.name in self.gpu_images]
        )
        for c in raw:
            values = batch[c.name]
            decoded.columns[c.name] = list(values if kept is None else values[kept])
        if self.on_gpu:
            ids, names = self._ids(batch), batch[self.row_names] if self.row_names else None
            if kept is not None:
                ids, names = ids[kept], names[kept] if names is not None else None
            decoded.rows_of = (ids, names)
        return decoded, kept

    def on_device(self, decoded: Decoded, device: torch.device, epoch: int | None = None) -> None:
        """With ``decode_device="cuda"``: the encoded images, still bytes after the rows'
        decoding, decoded on ``device`` in one call per column (``decode_jpegs``); then,
        with ``decode_batch_fn``, the batch through it (the images on the GPU)."""
        for name in self.gpu_images:
            if isinstance(decoded.columns.get(name), list):
                decoded.columns[name] = decode_jpegs(name, decoded.columns[name], device)
        if self.on_gpu:
            self._gpu_batch_fn(decoded, epoch)

    def _gpu_batch_fn(self, decoded: Decoded, epoch: int | None) -> None:
        """``decode_batch_fn`` on a batch whose JPEGs were decoded on the GPU: its columns
        and masks replace the batch's."""
        ids, names = decoded.rows_of
        result = self.local.decode_batch(decoded.columns, ids, names, epoch)
        self.padding[0] += result.padding[0]
        self.padding[1] += result.padding[1]
        decoded.columns, decoded.masks = result.decoded.columns, result.decoded.masks


def _pool_kind(pool: str, cpus: int, cpu_work: bool) -> str:
    if not cpu_work:
        return "gpu"  # all is decoded on the GPU, in the rank (decode_device="cuda")
    if pool == "auto":
        return "processes" if cpus > THREADS_UP_TO_CPUS else "threads"
    return pool


def decode_jpegs(name: str, images: list[bytes], device: torch.device) -> torch.Tensor:
    """JPEG images decoded on ``device`` (a GPU) in one batch by torchvision's
    ``decode_jpeg``, as uint8 ``[rows, 3, H, W]`` (RGB)."""
    decode_jpeg, ImageReadMode = require_gpu_jpeg()
    if not images:
        return torch.empty((0, 3, 0, 0), dtype=torch.uint8, device=device)
    joined = torch.frombuffer(bytearray().join(images), dtype=torch.uint8)  # one copy
    data = list(joined.split([len(b) for b in images]))
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
