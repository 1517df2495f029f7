"""Executor: a rank's decoding of its batches' variable columns, in threads or in worker
processes (``decode_pool``), and with ``decode_device="cuda"`` on its GPU.

The loader hands over batches whose variable columns (encoded images, Spark's image
structs, strings, arrays of varying length) are arrays of Python objects, in the rows'
seeded order. ``Decoder`` turns them into tensors with a ``BatchDecoding`` (the per-row
``decode_fn``, or ``decode_batch_fn``, and collation), in one of two ways, whose results
are the same, bit for bit:

- ``threads``: in the rank's own process, each batch's rows spread over ``workers`` threads
  (Pillow, simplejpeg and tokenizers release the GIL while they work; Python in a
  ``decode_fn`` does not, and the training thread waits for the same GIL);
- ``processes``: ``workers`` decode worker processes (``DecodePool``), forked from a fork
  server, each decoding whole batches into shared memory, several batches in flight
  (``ahead``; small batches sent several a message: ``pool.group_for``), taken out of it by
  the pool's own thread (views on a CPU, copies straight to the GPU on a GPU:
  ``delivery``).

``"auto"`` takes processes where the task has more than ``THREADS_UP_TO_CPUS`` CPUs (a
worker process costs its own memory and a start, which a task of one or two CPUs does not
win back), and threads where memory is too short for the workers' slots (noted in the
summary, which the driver warns of once). ``prime`` decodes a split's first rows in the
rank, to know the columns' decoded shapes (a batch without rows then gets zero rows of
each) and how large a batch is. ``decode_timeout`` bounds the seconds a batch may take, in
either pool (a thread that is stuck is left to itself; a worker process is killed). The
rank keeps what decoding reported: the rows left out (``bad_rows="skip"``, each counted once
however many epochs skip it) and the padding.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

import numpy as np
import torch

from ...shared.spec import ColumnSpec, DecodeSpec
from ..data.arrow_reader import ROW_ID
from ..data.binary_rows import BinaryRows
from ..data.columns import Columns
from .batch_decoding import BatchDecoding
from .decoded import BatchResult, Decoded, Recipe
from .delivery import Delivery, ready
from .gpu_jpeg import GpuJpegs
from .pool import DecodePool, DecodeTimeout, group_for, slots_per_worker
from .shared_memory import SHM_DIR_ENV, shm_folder, shm_free_bytes, shm_place

log = logging.getLogger(__name__)
T = TypeVar("T")
THREADS_UP_TO_CPUS = 2  # decode_pool="auto": threads for tasks of this many CPUs or fewer
SHM_SHARE = 0.5  # the most of the free memory the node's workers' slots may plan to take


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
    ``rank`` names the rank in errors, ``device`` is where its batches go (a GPU: training
    copies them there straight from the workers' slots, transform into pinned memory),
    ``batch_rows`` the usual rows of a batch (how many batches a message to a worker holds)
    and ``local_ranks`` the ranks on this node (with it, to size the workers' slots)."""

    def __init__(
        self,
        spec: DecodeSpec,
        columns: list[ColumnSpec],
        labels: set[str],
        seed: int,
        row_names: str | None = None,
        fit_labels: list[str] | None = None,
        rank: int | str = 0,
        device: torch.device | None = None,
        batch_rows: int = 256,
        local_ranks: int = 1,
    ):
        self.spec, self.row_names, self._rank = spec, row_names, rank
        self.device = device or torch.device("cpu")
        self.batch_rows, self.local_ranks = batch_rows, local_ranks
        variable = tuple(c for c in columns if c.variable)
        fit = tuple(fit_labels) if fit_labels is not None else None
        self.training = fit is None

        def recipe(decoded: tuple[ColumnSpec, ...]) -> Recipe:
            return Recipe(spec, decoded, frozenset(labels), seed, row_names, fit)

        self.gpu = GpuJpegs(spec, variable, BatchDecoding(recipe(variable)))
        cpu = self.gpu.cpu_columns()
        self.recipe = recipe(cpu)
        self.local = BatchDecoding(self.recipe)  # the rank's own: threads, and priming
        self.columns = list(variable)
        cpus = task_cpus()
        self.kind = _pool_kind(spec.pool, cpus, bool(cpu))
        self.workers = default_workers(self.kind, cpus)
        if spec.workers and self.kind != "gpu":
            self.workers = spec.workers
        self.threads: ThreadPoolExecutor | None = None  # the rows' spans of a batch
        self.waiter: ThreadPoolExecutor | None = None  # with decode_timeout: a batch's thread
        self.processes: DecodePool | None = None
        self.skipped_rows: set[tuple[bool, int]] = set()  # (validation?, row) left out
        self.padding = [0, 0]  # values of padded sequences: real, in all (with the padding)
        self.empty: Decoded | None = None  # zero rows of each column, as decoded (``prime``)
        self.note: str | None = None  # why processes were asked for and threads decode
        self.slot_bytes = 0  # a worker's slot for a batch like the first (``prime``)
        self.primed = False

    @property
    def rank(self) -> int | str:
        return self._rank

    @rank.setter
    def rank(self, rank: int | str) -> None:
        self._rank = rank
        if self.processes is not None:
            self.processes.rank = rank

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
            self.skipped_rows, self.padding = set(), [0, 0]
            if decoded.rows:
                self.empty = decoded.empty()
                self._check_memory(decoded)
        except BaseException:
            self.close()
            raise

    def _check_memory(self, decoded: Decoded) -> None:
        """Worker processes decode into shared memory: where there is too little of it for
        their slots for batches of ``batch_rows`` rows like ``decoded``'s (this rank's share
        of what is free on the node), small batches go fewer a message (their slots are
        counted by it: ``group_for``), and where even one a message does not fit, threads
        decode instead."""
        if self.processes is None:
            return
        tensors = decoded.tensors().values()
        row = sum(t.numel() * t.element_size() for t in tensors) / decoded.rows
        self.slot_bytes = int(row * self.batch_rows * 1.25)
        mode, group = self._delivery_mode(), group_for(self.batch_rows)
        free = shm_free_bytes()
        share = free * SHM_SHARE / max(1, self.local_ranks)
        while True:
            slots = slots_per_worker(mode, group)
            need = self.slot_bytes * slots * self.workers
            if need <= share:
                self.processes.regroup(group)
                return
            if group == 1:
                break
            group //= 2
        self.processes.close()
        self.processes = None
        folder = shm_folder()
        where = (
            "set SPARK_ESTIMATOR_SHM_DIR to a larger tmpfs, or unset it (anonymous memory "
            "is not bound by a folder's size)"
            if folder
            else "give the executors more memory"
        )
        self.note = (
            f"decode_pool: worker processes decode into shared memory ({shm_place()}), of "
            f"which {free / 2**20:.0f} MiB is free, {share / 2**20:.0f} MiB for each of the "
            f"node's {self.local_ranks} rank(s), and {self.workers} of them need about "
            f"{need / 2**20:.0f} MiB ({slots} batches of {self.batch_rows} rows each); "
            f"decoding in threads instead, which is slower. Lower decode_workers or "
            f"batch_size, or {where}"
        )
        self.kind = "threads"
        self.workers = self.spec.workers or default_workers("threads", task_cpus())
        self._start()

    def _start(self) -> None:
        if self.kind == "processes" and self.processes is None:
            self.processes = DecodePool(
                self.recipe,
                self.workers,
                self._rank,
                self._delivery(),
                self.spec.timeout,
                group_for(self.batch_rows),
            )
        elif self.kind == "threads" and self.threads is None:
            if self.workers > 1:
                self.threads = ThreadPoolExecutor(
                    self.workers, thread_name_prefix="spark-estimator-decode"
                )
            if self.spec.timeout is not None and self.waiter is None:
                self.waiter = ThreadPoolExecutor(1, thread_name_prefix="spark-estimator-batch")

    def _delivery_mode(self) -> str:
        """How batches leave the workers' slots: views on a CPU; on a GPU, copied to it
        (training) or into pinned memory (transform, which joins parts first)."""
        if self.device.type != "cuda":
            return "view"
        return "device" if self.training else "pin"

    def _delivery(self) -> Delivery:
        mode = self._delivery_mode()
        return Delivery(mode, self.device if mode == "device" else None)

    @property
    def skipped(self) -> int:
        """The rows left out (``bad_rows="skip"``), each counted once."""
        return len(self.skipped_rows)

    @property
    def share(self) -> Callable[[Columns], Columns] | None:
        """What the loader hands each chunk to as it is read: with worker processes, the
        pool's ``SharedRows.share`` (the rows' bytes read into shared memory, where the
        workers read them); None with threads."""
        return self.processes.shared.share if self.processes is not None else None

    def summary(self) -> dict:
        """How this rank decoded, for its summary."""
        out = {"pool": self.kind, "workers": self.workers}
        note = self.note
        if self.processes is not None:
            found = self.processes.summary()
            reason = found.pop("inline_reason", None)
            if reason and not note:
                note = (
                    f"decode_pool: no shared memory could be had for some batches ({reason}); "
                    "they went through the workers' sockets, which is slower"
                )
            out.update(found)
        if note:
            out["note"] = note
        return out

    def close(self) -> None:
        for threads in (self.threads, self.waiter):
            if threads is not None:
                threads.shutdown(wait=False, cancel_futures=True)
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
            if result.ready is not None:  # copied to the GPU: this stream waits for it
                ready(result)
            yield item, self._finish(result, batch_of(item))
            result = None  # not kept by this frame (a traceback keeps frames)

    def _decode_here(self, batch: Mapping, epoch: int | None) -> BatchResult:
        values, ids, names = self._raw(batch)
        values = {n: np.asarray(v) if isinstance(v, BinaryRows) else v for n, v in values.items()}
        if not self.recipe.columns:  # all decoded on the GPU (GpuJpegs)
            return BatchResult(Decoded({}, {}, len(ids)))
        if self.spec.timeout is None:
            return self.local.decode(values, ids, names, epoch, self.threads)
        # the batch in a thread of its own, waited for at most decode_timeout
        future = self.waiter.submit(self.local.decode, values, ids, names, epoch, self.threads)
        try:
            return future.result(timeout=self.spec.timeout)
        except FutureTimeout:
            first = int(ids[0]) if len(ids) else None
            named = f" ({self.row_names} {names[0]})" if names is not None and len(ids) else ""
            raise DecodeTimeout(
                f"decode_timeout: decoding the batch whose first row is {first} of the "
                f"split{named} took more than {self.spec.timeout:g} s in a thread of "
                f"{self._who()} (left to end by itself). Find what the decoding waits on "
                "there (a slow or stuck read, a lock), or raise decode_timeout"
            ) from None

    def _who(self) -> str:
        return f"rank {self._rank}" if isinstance(self._rank, int) else str(self._rank)

    def _raw(self, batch: Mapping) -> tuple[dict, np.ndarray, np.ndarray | None]:
        """A batch's values of the columns decoded on the CPU, its row indices and names."""
        values = {c.name: batch[c.name] for c in self.recipe.columns}
        ids = self._ids(batch)
        names = batch[self.row_names] if self.row_names else None
        return values, ids, names

    def _ids(self, batch: Mapping) -> np.ndarray:
        try:
            return batch[ROW_ID].numpy()
        except KeyError:
            pass
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
        if self.gpu.images or self.gpu.whole:
            names = batch[self.row_names] if self.row_names else None
            self.gpu.keep_bytes(decoded, batch, kept, self._ids(batch), names)
        return decoded, kept

    def on_device(self, decoded: Decoded, device: torch.device, epoch: int | None = None) -> None:
        """With ``decode_device="cuda"``: the encoded images, still bytes after the rows'
        decoding, decoded on ``device`` (``GpuJpegs``); then, with ``decode_batch_fn``, the
        batch through it."""
        if not (self.gpu.images or self.gpu.whole):
            return
        padding = self.gpu.decode(decoded, device, epoch, self.local)
        self.padding[0] += padding[0]
        self.padding[1] += padding[1]


def _pool_kind(pool: str, cpus: int, cpu_work: bool) -> str:
    if not cpu_work:
        return "gpu"  # all is decoded on the GPU, in the rank (decode_device="cuda")
    if pool == "auto":
        return "processes" if cpus > THREADS_UP_TO_CPUS else "threads"
    return pool


__all__ = ["Decoder", "DecodeTimeout", "SHM_DIR_ENV"]
