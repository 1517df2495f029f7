"""Executor: a rank's whole shard held in its device's memory, cut into batches there.

When a rank's shards of both splits fit its memory budget (``placement``), they are read
once, every piece in file order through the same reader as streaming, into contiguous
tensors on the rank's device (GPU memory, or RAM for CPU ranks): the scalar columns of one
dtype as one ``[columns, rows]`` block, so each column is a contiguous row of it, and every
other column as one tensor. Each pass draws its order on the host from the streaming
loader's generator (seeded by seed, pass and rank): the pieces permuted, then the rows
through the streaming loader's buffer refills, on indices (``shuffle.pass_order``). That is
the order the streaming loader gives, whatever the shard's and the buffer's sizes, so both
paths train alike and a launch may go on from another's commit either way. The order goes
to the device once per pass as one index tensor, and a batch is one ``index_select`` per
block: nothing per step on the host but slicing, and no synchronisation with the device.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import torch

from ...shared.spec import ColumnSpec, TrainSpec
from .arrow_reader import Chunk
from .convert import (
    Tensors,
    as_tensor,
    chunk_rows,
    host_to_device,
    read_only_arrays,
    scalar_groups,
)
from .shards import Piece, pass_generator, piece_order
from .shuffle import default_buffer_rows, pass_order


class DeviceShard:
    """One split of a rank's shard on ``device``; batches like ``ShardLoader.batches``."""

    def __init__(
        self,
        read_chunks: Callable[[list[Piece]], Iterator[Chunk]],
        pieces: list[Piece],
        template: Tensors,
        columns: list[ColumnSpec],
        *,
        shuffle: bool,
        shuffle_pieces: bool,
        buffer_rows: int | None,
        seed: int,
        rank: int,
        device: torch.device,
    ):
        self.pieces, self.shuffle, self.shuffle_pieces = pieces, shuffle, shuffle_pieces
        self.buffer_rows = buffer_rows
        self.seed, self.rank, self.device = seed, rank, device
        self.rows = sum(p.rows for p in pieces)
        starts = [0]
        for piece in pieces:
            starts.append(starts[-1] + piece.rows)
        self.starts = starts  # the first row of each piece in the held tensors
        self._hold(read_chunks(pieces), template, columns)

    def _hold(self, chunks: Iterator[Chunk], template: Tensors, columns: list[ColumnSpec]):
        """Copy every chunk into place: the scalar columns into their dtype's block."""
        self.blocks: dict[torch.dtype, tuple[torch.Tensor, list[str]]] = {}
        self.columns: dict[str, torch.Tensor] = {}
        scalars = scalar_groups(template, columns)
        for dtype, names in scalars.items():
            block = torch.empty((len(names), self.rows), dtype=dtype, device=self.device)
            self.blocks[dtype] = (block, names)
        where = {n: (dtype, j) for dtype, names in scalars.items() for j, n in enumerate(names)}
        at = 0
        for chunk in chunks:
            n = chunk_rows(chunk)
            for name, like in template.items():
                with read_only_arrays():
                    values = as_tensor(chunk[name], like.dtype)
                if name in where:
                    dtype, j = where[name]
                    self.blocks[dtype][0][j, at : at + n].copy_(values)
                    continue
                if name not in self.columns:
                    shape = (self.rows, *values.shape[1:])
                    self.columns[name] = torch.empty(shape, dtype=like.dtype, device=self.device)
                self.columns[name][at : at + n].copy_(values)
            at += n
        for name, like in template.items():  # an empty shard: the template's row shapes
            if name not in where and name not in self.columns:
                self.columns[name] = like.to(self.device)
        self.names = list(template)

    @property
    def nbytes(self) -> int:
        held = [b for b, _ in self.blocks.values()] + list(self.columns.values())
        return sum(t.numel() * t.element_size() for t in held)

    def order(self, pass_index: int) -> torch.Tensor | None:
        """The pass's row order as indices into the held rows (None: file order): the
        streaming loader's (``shuffle.pass_order``), its buffer sized from the same rows."""
        if not self.shuffle or not self.rows:
            return None
        generator = pass_generator(self.seed, pass_index, self.rank)
        order = piece_order(self.pieces, generator if self.shuffle_pieces else None)
        rows = torch.cat([torch.arange(self.starts[i], self.starts[i + 1]) for i in order])
        buffer = self.buffer_rows or default_buffer_rows(self.nbytes // self.rows)
        served = pass_order([self.pieces[i].rows for i in order], buffer, generator)
        return host_to_device(rows[served], self.device)

    def batches(self, sizes: list[int], pass_index: int) -> Iterator[Tensors]:
        """One pass: batches of ``sizes`` rows, new tensors (never views of the held rows,
        so a batch edited in place leaves them as they are)."""
        if sum(sizes) > self.rows:
            raise ValueError(f"loader: {sum(sizes)} rows asked of a shard of {self.rows}")
        index, cursor = self.order(pass_index), 0
        for size in sizes:
            yield self._take(index, cursor, size)
            cursor += size

    def _take(self, index: torch.Tensor | None, start: int, size: int) -> Tensors:
        if index is None:

            def pick(tensor, dim):
                return tensor.narrow(dim, start, size).clone()
        else:
            rows = index[start : start + size]

            def pick(tensor, dim):
                return tensor.index_select(dim, rows)

        batch = {}
        for block, names in self.blocks.values():
            taken = pick(block, 1)
            batch.update(zip(names, taken.unbind(0)))
        for name, column in self.columns.items():
            batch[name] = pick(column, 0)
        return {name: batch[name] for name in self.names}


def placement(spec: TrainSpec, rows: dict[str, int], device: torch.device, local_size: int):
    """Whether this rank holds its shard on ``device`` (rows of each split: ``rows``), and
    the line saying why or why not."""
    fraction = spec.loader.device_cache_fraction
    if not fraction:
        return False, "streaming: device_cache_fraction is 0"
    if spec.loader.transformation_fn is not None:
        return False, "streaming: transformation_fn runs on every batch on the host"
    if spec.data.variable:
        names = ", ".join(f"'{c.name}'" for c in spec.data.variable)
        return False, f"streaming: column {names} is decoded per batch on the host"
    row_bytes = 0
    for column in spec.data.columns:
        length = spec.data.row_length(column)
        if length is None:
            return False, f"streaming: the row size of column '{column.name}' is not recorded"
        row_bytes += length * column.torch_dtype.itemsize
    index_bytes = rows.get("train", 0) * 8 if spec.loader.shuffle else 0
    needed = sum(rows.values()) * row_bytes + index_bytes
    budget, source = memory_budget(device, fraction, local_size)
    size = f"{needed / 2**20:.1f} MiB"
    if needed > budget:
        return False, (
            f"streaming: the shard needs {size}, over the budget of {budget / 2**20:.1f} MiB "
            f"(device_cache_fraction {source})"
        )
    return True, f"held on {device}: {size} within {budget / 2**20:.1f} MiB ({source})"


def memory_budget(device: torch.device, fraction: float, local_size: int) -> tuple[int, str]:
    """Bytes a rank may hold on ``device`` and how they were found: ``fraction`` of the
    GPU's free memory, or of the RAM available to this host's ``local_size`` processes."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * fraction), f"{fraction:g} x {free / 2**20:.0f} MiB free on {device}"
    available = available_ram()
    share = int(available * fraction / max(1, local_size))
    shared = f" / {local_size} processes on this host" if local_size > 1 else ""
    return share, f"{fraction:g} x {available / 2**20:.0f} MiB of available RAM{shared}"


def available_ram() -> int:
    """RAM this process may still use: the OS's available memory, or less under a cgroup
    memory limit (containers, YARN, Kubernetes)."""
    values = []
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        values.append(int(info["MemAvailable"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        values.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    for limit, used in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            with open(limit) as f, open(used) as g:
                cap = f.read().strip()
                if cap != "max" and int(cap) < 2**60:
                    values.append(max(0, int(cap) - int(g.read())))
        except (OSError, ValueError):
            continue
    return min(values)
