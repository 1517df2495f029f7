"""Executor: a chunk, buffer or batch whose scalar columns of one dtype are one row-major block.

The streaming loader holds the scalar columns of each dtype as one ``[rows, columns]``
block (``Layout.assemble``, run in the reader threads as each piece is read), and every
other column (arrays, vectors) as a tensor of its own. So the shuffle moves whole rows, one
``index_copy_`` per block and piece; a batch is a range of the buffer's rows, one view per
block and other column (one ``split`` per block cuts all the batches of a refill); and it
goes to the device as one copy per block, straight from the (pinned) buffer. ``Columns``
reads as a Mapping of column name to tensor; a scalar column's tensor is a strided view of
its block, made when asked for.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import cached_property

import numpy as np
import pyarrow as pa
import torch

from ...shared.spec import ColumnSpec
from .binary_rows import BinaryRows
from .convert import as_tensor, read_only_arrays, scalar_groups

RAW_TYPES = (np.ndarray, BinaryRows)  # how a variable column's rows are held


class Layout:
    """Which columns of ``template`` (column name -> tensor in its dtype, or an object
    array for a variable column) form blocks: the scalar ``columns`` of one dtype
    (``scalar_groups``); the rest stand alone, the variable columns (``raws``) as
    ``BinaryRows`` (binary and string columns) or NumPy arrays of Python objects
    (sequences, image structs), decoded per batch."""

    def __init__(self, template: Mapping, columns: list[ColumnSpec]):
        self.template = template
        self.names = list(template)
        self.raws = [n for n in self.names if isinstance(template[n], RAW_TYPES)]
        self.raw_index = {n: i for i, n in enumerate(self.raws)}
        tensors = {n: t for n, t in template.items() if n not in self.raw_index}
        self.dtypes = {name: tensor.dtype for name, tensor in tensors.items()}
        self.groups = list(scalar_groups(tensors, columns).items())  # [(dtype, names)]
        self.where = {
            n: (g, j) for g, (_, names) in enumerate(self.groups) for j, n in enumerate(names)
        }
        self.others = [n for n in tensors if n not in self.where]
        self.other_index = {n: i for i, n in enumerate(self.others)}

    @cached_property
    def empty(self) -> Columns:
        """Zero rows of every column (with the template's row shapes)."""
        return self.assemble(self.template)

    def allocate(self, rows: int, like: Mapping, pin: bool) -> Columns:
        """New, unfilled columns of ``rows`` rows, other columns shaped as ``like``'s rows."""
        blocks = [host_empty((rows, len(names)), dtype, pin) for dtype, names in self.groups]
        others = [host_empty((rows, *like[n].shape[1:]), self.dtypes[n], pin) for n in self.others]
        raws = [_no_rows_like(self.template[n], rows) for n in self.raws]
        return Columns(self, blocks, others, raws)

    def assemble(self, chunk: Mapping, pin: bool = False) -> Columns:
        """``chunk``'s columns (NumPy arrays, maybe read-only Arrow memory, or tensors) laid
        out so: each scalar group copied into one new block (pinned with ``pin``), the
        other columns zero-copy tensors of the chunk's memory."""
        rows = len(chunk[self.names[0]]) if self.names else 0
        blocks = []
        with read_only_arrays():
            for dtype, names in self.groups:
                block = host_empty((rows, len(names)), dtype, pin)
                for j, name in enumerate(names):
                    place(block[:, j], as_tensor(chunk[name], dtype))
                blocks.append(block)
            others = [as_tensor(chunk[n], self.dtypes[n]) for n in self.others]
        raws = [_raw(chunk[n], self.template[n]) for n in self.raws]
        return Columns(self, blocks, others, raws)


def _no_rows_like(template, rows: int):
    """``rows`` rows to be set of a variable column held as ``template``."""
    if isinstance(template, BinaryRows):
        return BinaryRows.empty(rows, template.text)
    return np.empty(rows, dtype=object)


def _raw(values, template):
    """A variable column's rows as the template's kind holds them (a reader that gives
    objects, such as petastorm's, has them made ``BinaryRows``)."""
    if isinstance(template, BinaryRows):
        if isinstance(values, BinaryRows):
            return values
        kind = pa.string() if template.text else pa.binary()
        return BinaryRows.from_arrow(pa.array(list(values), kind))
    if isinstance(values, BinaryRows):
        return np.asarray(values)
    return np.asarray(values, dtype=object)


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A new host tensor: pinned with ``pin`` (torch caches pinned blocks), otherwise
    allocated by NumPy where it has the dtype. NumPy asks the kernel for transparent huge
    pages on large arrays, which makes the first touch of a buffer of many MiB several times
    cheaper than ``torch.empty``'s 4 KiB pages (measured: 132 MiB in 15 ms, not 60)."""
    if not pin:
        try:
            like = torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError:  # bfloat16 and other dtypes NumPy lacks
            pass
        else:
            return torch.from_numpy(np.empty(shape, dtype=like))
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


def place(target, source, index: torch.Tensor | None = None):
    """``target[:] = source``, or with ``index`` ``target[index] = source`` (rows), on the
    host. Done by NumPy where it has the dtype: single-threaded, at memory speed, without
    holding the GIL. torch's kernels for the same copies split such small work over its
    intra-op threads, which measured 10 to 100 times slower whenever those threads share
    busy cores (a strided column copy of 65,536 rows: 2.8 ms in NumPy, 264 ms in torch
    with 2 threads on 2 loaded cores), as on an executor running several tasks. Object
    arrays and ``BinaryRows`` (a variable column's rows) are set by themselves."""
    if isinstance(target, RAW_TYPES):
        target[index.numpy() if index is not None else ...] = source
        return
    try:
        target_np, source_np = target.numpy(), source.numpy()
    except (TypeError, RuntimeError):  # dtypes NumPy lacks (bfloat16), autograd tensors
        if index is None:
            target.copy_(source)
        else:
            target.index_copy_(0, index, source)
        return
    if index is None:
        target_np[...] = source_np
    else:
        target_np[index.numpy()] = source_np


class Columns(Mapping):
    """Equally long columns laid out by ``layout``: ``blocks`` (``[rows, columns]``, one
    per scalar group, in ``layout.groups`` order), ``others`` (in ``layout.others`` order)
    and ``raws``, the variable columns' object arrays (in ``layout.raws`` order)."""

    __slots__ = ("layout", "blocks", "others", "raws")

    def __init__(
        self,
        layout: Layout,
        blocks: list[torch.Tensor],
        others: list[torch.Tensor],
        raws: list[np.ndarray | BinaryRows] | None = None,
    ):
        self.layout, self.blocks, self.others = layout, blocks, others
        self.raws = raws or []

    def __getitem__(self, name: str):
        where = self.layout.where.get(name)
        if where is None:
            if name in self.layout.raw_index:
                return self.raws[self.layout.raw_index[name]]
            return self.others[self.layout.other_index[name]]
        group, j = where
        return self.blocks[group][:, j]

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.names)

    def __len__(self) -> int:
        return len(self.layout.names)

    @property
    def rows(self) -> int:
        first = self.blocks or self.others or self.raws
        return len(first[0])

    def tensors(self) -> list[torch.Tensor]:
        """The tensors holding the columns: the blocks, then the other columns."""
        return [*self.blocks, *self.others]

    def parts(self) -> list:
        """Everything holding the columns: the tensors, then the object arrays."""
        return [*self.blocks, *self.others, *self.raws]

    def narrow(self, start: int, length: int) -> Columns:
        """Rows ``start`` to ``start + length`` (views)."""
        return Columns(
            self.layout,
            [b.narrow(0, start, length) for b in self.blocks],
            [t.narrow(0, start, length) for t in self.others],
            [r[start : start + length] for r in self.raws],
        )

    def split(self, sizes: list[int]) -> list[Columns]:
        """Consecutive row ranges of ``sizes`` rows (views), one ``split`` per tensor."""
        blocks = [b.split(sizes) for b in self.blocks]
        others = [t.split(sizes) for t in self.others]
        cuts = [0, *np.cumsum(sizes).tolist()]
        raws = [[r[a:b] for a, b in zip(cuts, cuts[1:])] for r in self.raws]
        return [
            Columns(
                self.layout, [b[i] for b in blocks], [t[i] for t in others], [r[i] for r in raws]
            )
            for i in range(len(sizes))
        ]

    def take(self, rows: np.ndarray) -> Columns:
        """The rows at positions ``rows`` (copies): a batch without its rows that failed."""
        index = torch.from_numpy(rows)
        return Columns(
            self.layout,
            [b.index_select(0, index) for b in self.blocks],
            [t.index_select(0, index) for t in self.others],
            [r[rows] for r in self.raws],
        )

    def to(self, device: torch.device) -> Columns:
        """The columns on ``device``, one copy per block and per other column (a range of
        rows of each is contiguous); on a GPU from pinned memory, not blocking the host.
        Object arrays stay on the host."""
        cuda = device.type == "cuda"
        return Columns(
            self.layout,
            [b.to(device, non_blocking=cuda) for b in self.blocks],
            [t.to(device, non_blocking=cuda) for t in self.others],
            self.raws,
        )
