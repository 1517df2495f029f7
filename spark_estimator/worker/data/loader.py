"""Executor: one rank's shard of a split as batches of tensors, seeded and exact.

A pass reads the rank's pieces (row-group slices, see ``shards.py``) through a reader that
prefetches in the background, and cuts them into batches of the sizes the step plan asks
for, so every row of the shard is in exactly one batch per pass. With ``shuffle`` the piece
order is permuted per pass, and rows go through a bounded shuffle buffer: the buffer is
refilled to ``buffer_rows`` rows whenever half of it has been consumed, and each refill is
permuted, so every row is copied about twice, never once per batch. The permutations come
from a generator seeded by (seed, pass, rank): the same seed gives the same batches, and
each pass a different order. With ``cache`` the shard's pieces stay in memory after the
first pass. On a GPU the buffer lives in pinned memory so batches copy without blocking.
Readers hand over NumPy arrays (often Arrow's own memory); the buffer is the only copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from ...shared.spec import TrainSpec
from .arrow_reader import ArrowReader, Chunk
from .convert import Tensors, as_tensor, chunk_rows, read_only_arrays
from .device_shard import DeviceShard
from .petastorm_reader import PetastormReader
from .shards import Piece, pass_generator, shard_pieces

DEFAULT_BUFFER_BYTES = 256 * 2**20


def _gather(parts: list, perm: torch.Tensor | None, template: Tensors, pin: bool) -> Tensors:
    """The rows of ``parts`` in one new tensor per column (``pool[i] = rows[perm[i]]``).

    One copy per row: straight into place (``index_copy_`` with the inverse permutation),
    without concatenating first. The result never shares memory with the parts, so a batch
    edited in place cannot change cached chunks.
    """
    sizes = [chunk_rows(p) for p in parts]
    destinations = None
    if perm is not None:
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(len(perm))
        destinations = inverse.split(sizes)
    out = {}
    for name, like in template.items():
        with read_only_arrays():
            tensors = [as_tensor(p[name], like.dtype) for p in parts]
        shape = (sum(sizes), *tensors[0].shape[1:])
        target = torch.empty(shape, dtype=like.dtype, pin_memory=pin)
        if destinations is None:
            torch.cat(tensors, out=target)
        else:
            for tensor, where in zip(tensors, destinations):
                target.index_copy_(0, where, tensor)
        out[name] = target
    return out


def buffered_batches(
    chunks: Iterable[Chunk],
    sizes: list[int],
    template: Tensors,
    *,
    buffer_rows: int | None,
    generator: torch.Generator | None,
    pin_memory: bool = False,
) -> Iterator[Tensors]:
    """Cut a stream of chunks into batches of ``sizes`` rows.

    Without a generator rows keep their order. With one, rows pass through a shuffle buffer
    of ``buffer_rows`` rows (``None``: about 256 MiB worth, sized from the first chunk).
    ``template`` gives each column's dtype (and, for empty shards, its row shape). After a
    refill, every batch that the buffer serves before the next refill is cut in one
    ``split`` per column.
    """
    chunks = iter(chunks)
    pool, cursor, exhausted = template, 0, False

    def wanted(size: int, divisor: int) -> int:
        if generator is None or buffer_rows is None:
            return size
        return max(size, buffer_rows // divisor)

    i = 0
    while i < len(sizes):
        left = chunk_rows(pool) - cursor
        if left < wanted(sizes[i], 2) and not exhausted:
            parts = [{k: v[cursor:] for k, v in pool.items()}] if left else []
            while left < wanted(sizes[i], 1):
                chunk = next(chunks, None)
                if chunk is None:
                    exhausted = True
                    break
                if generator is not None and buffer_rows is None:
                    buffer_rows = default_buffer_rows(chunk)
                parts.append(chunk)
                left += chunk_rows(chunk)
            if parts:
                perm = None if generator is None else torch.randperm(left, generator=generator)
                pool, cursor = _gather(parts, perm, template, pin_memory), 0
        j, take = i, 0  # batches i..j-1 come from this pool before a refill is due
        while j < len(sizes) and sizes[j] <= left - take:
            if j > i and not exhausted and left - take < wanted(sizes[j], 2):
                break
            take += sizes[j]
            j += 1
        if j == i:
            raise RuntimeError(
                f"loader: the shard ran out of rows ({left} left for a batch of {sizes[i]}); "
                "did the dataset change while training?"
            )
        cut = {k: v[cursor : cursor + take].split(sizes[i:j]) for k, v in pool.items()}
        for n in range(j - i):
            yield {k: pieces[n] for k, pieces in cut.items()}
        cursor, i = cursor + take, j


def default_buffer_rows(chunk: Chunk) -> int:
    """As many rows as fit in DEFAULT_BUFFER_BYTES, judged by the rows of ``chunk``."""
    rows = chunk_rows(chunk)
    row_bytes = sum(a.nbytes for a in chunk.values()) // rows if rows else 1
    return max(1, DEFAULT_BUFFER_BYTES // max(1, row_bytes))


class ShardLoader:
    """Batches of one rank's pieces of one split, pass after pass.

    ``read_chunks(pieces)`` yields one chunk per piece in the order given (a reader's
    ``chunks``); ``shuffle_pieces`` is False for readers that can only go in file order.
    """

    def __init__(
        self,
        read_chunks: Callable[[list[Piece]], Iterator[Chunk]],
        pieces: list[Piece],
        template: Tensors,
        *,
        shuffle: bool,
        shuffle_pieces: bool,
        buffer_rows: int | None,
        seed: int,
        rank: int,
        cache: bool,
        pin_memory: bool,
    ):
        self.read_chunks, self.pieces, self.template = read_chunks, pieces, template
        self.shuffle, self.shuffle_pieces, self.buffer_rows = shuffle, shuffle_pieces, buffer_rows
        self.seed, self.rank, self.pin_memory = seed, rank, pin_memory
        self.cache: dict[Piece, Chunk] | None = {} if cache else None
        self.rows = sum(p.rows for p in pieces)

    def batches(self, sizes: list[int], pass_index: int) -> Iterator[Tensors]:
        """One pass: batches of ``sizes`` rows (summing to the shard's rows)."""
        if sum(sizes) > self.rows:
            raise ValueError(f"loader: {sum(sizes)} rows asked of a shard of {self.rows}")
        generator = pass_generator(self.seed, pass_index, self.rank) if self.shuffle else None
        order = self.pieces
        if generator is not None and self.shuffle_pieces:
            order = [self.pieces[i] for i in torch.randperm(len(order), generator=generator)]
        yield from buffered_batches(
            self._chunks(order),
            sizes,
            self.template,
            buffer_rows=self.buffer_rows,
            generator=generator,
            pin_memory=self.pin_memory,
        )

    def _chunks(self, order: list[Piece]) -> Iterator[Chunk]:
        cache = self.cache
        if cache is None:
            yield from self.read_chunks(order)
            return
        fresh = self.read_chunks([p for p in order if p not in cache])
        try:
            for piece in order:
                if piece not in cache:
                    cache[piece] = next(fresh)
                yield cache[piece]
        finally:
            fresh.close()


def open_loader(
    spec: TrainSpec,
    split: str,
    world_size: int,
    rank: int,
    pin: bool,
    hold_on: torch.device | None = None,
) -> ShardLoader | DeviceShard:
    """The loader of this rank's shard of ``split``, reading with ``spec.loader.reader``;
    with ``hold_on``, the whole shard read once into that device's memory instead."""
    data, options = spec.data, spec.loader
    files = data.files.get(split, [])
    if options.reader == "petastorm":
        reader = PetastormReader(spec.store, data.path, data.columns, options.num_workers, files)
    else:
        reader = ArrowReader(spec.store, data.path, data.columns, options.num_workers)
    pieces = shard_pieces(files, world_size, rank)
    template = _template(spec, files, needs_shapes=not pieces)
    shuffle = options.shuffle and split == "train"
    if hold_on is not None:
        return DeviceShard(
            reader.chunks,
            pieces,
            template,
            data.columns,
            shuffle=shuffle,
            shuffle_pieces=reader.keeps_order,
            seed=spec.seed,
            rank=rank,
            device=hold_on,
        )
    return ShardLoader(
        reader.chunks,
        pieces,
        template,
        shuffle=shuffle,
        shuffle_pieces=reader.keeps_order,
        buffer_rows=options.shuffle_buffer_size,
        seed=spec.seed,
        rank=rank,
        cache=options.inmemory_cache_all,
        pin_memory=pin,
    )


def empty_batch(spec: TrainSpec, split: str) -> Tensors:
    """A batch of zero rows of ``split``, its columns in their dtypes and row shapes."""
    return _template(spec, spec.data.files.get(split, []), needs_shapes=True)


def _template(spec: TrainSpec, files, needs_shapes: bool) -> Tensors:
    """Zero rows of every column in its dtype; with the real row shapes (one row read) for
    a rank without rows, whose empty batches still go through forward()."""
    columns = spec.data.columns
    if not files or not needs_shapes:
        return {c.name: torch.empty(0, dtype=c.torch_dtype) for c in columns}
    path, groups = files[0]
    reader = ArrowReader(spec.store, spec.data.path, columns, num_workers=1)
    one_row = reader.read(Piece(path, 0, 0, 1, groups[0]))
    with read_only_arrays():
        return {c.name: as_tensor(one_row[c.name][:0], c.torch_dtype) for c in columns}
