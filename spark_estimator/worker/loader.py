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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from ..spec import TrainSpec
from .arrow_reader import ArrowReader
from .petastorm_reader import PetastormReader
from .shards import Piece, shard_pieces

Chunk = dict[str, torch.Tensor]
DEFAULT_BUFFER_BYTES = 256 * 2**20


def pass_generator(seed: int, pass_index: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + pass_index * 7919 + rank)


def chunk_rows(chunk: Chunk) -> int:
    return len(next(iter(chunk.values())))


def _gather(parts: list[Chunk], perm: torch.Tensor | None, pin: bool) -> Chunk:
    """The rows of ``parts`` concatenated (always a fresh copy), optionally permuted."""
    out = {}
    for name in parts[0]:
        tensors = [p[name] for p in parts]
        rows = sum(len(t) for t in tensors)
        first = tensors[0]
        target = torch.empty((rows, *first.shape[1:]), dtype=first.dtype, pin_memory=pin)
        if perm is None:
            torch.cat(tensors, out=target)
        else:
            torch.index_select(torch.cat(tensors), 0, perm, out=target)
        out[name] = target
    return out


def buffered_batches(
    chunks: Iterable[Chunk],
    sizes: Iterable[int],
    empty: Chunk,
    *,
    buffer_rows: int | None,
    generator: torch.Generator | None,
    pin_memory: bool = False,
) -> Iterator[Chunk]:
    """Cut a stream of chunks into batches of ``sizes`` rows.

    Without a generator rows keep their order. With one, rows pass through a shuffle buffer
    of ``buffer_rows`` rows (``None``: about 256 MiB worth, sized from the first chunk).
    """
    chunks = iter(chunks)
    pool, cursor, exhausted = empty, 0, False

    def wanted(size: int, divisor: int) -> int:
        if generator is None or buffer_rows is None:
            return size
        return max(size, buffer_rows // divisor)

    for size in sizes:
        left = chunk_rows(pool) - cursor
        if left < wanted(size, 2) and not exhausted:
            parts = [{k: v[cursor:] for k, v in pool.items()}] if left else []
            while left < wanted(size, 1):
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
                pool, cursor = _gather(parts, perm, pin_memory), 0
        if chunk_rows(pool) - cursor < size:
            raise RuntimeError(
                f"loader: the shard ran out of rows ({chunk_rows(pool) - cursor} left for a "
                f"batch of {size}); did the dataset change while training?"
            )
        yield {k: v[cursor : cursor + size] for k, v in pool.items()}
        cursor += size


def default_buffer_rows(chunk: Chunk) -> int:
    """As many rows as fit in DEFAULT_BUFFER_BYTES, judged by the rows of ``chunk``."""
    row_bytes = (
        sum(t[0].numel() * t.element_size() for t in chunk.values()) if chunk_rows(chunk) else 1
    )
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
        empty: Chunk,
        *,
        shuffle: bool,
        shuffle_pieces: bool,
        buffer_rows: int | None,
        seed: int,
        rank: int,
        cache: bool,
        pin_memory: bool,
    ):
        self.read_chunks, self.pieces, self.empty = read_chunks, pieces, empty
        self.shuffle, self.shuffle_pieces, self.buffer_rows = shuffle, shuffle_pieces, buffer_rows
        self.seed, self.rank, self.pin_memory = seed, rank, pin_memory
        self.cache: dict[Piece, Chunk] | None = {} if cache else None
        self.rows = sum(p.rows for p in pieces)

    def batches(self, sizes: list[int], pass_index: int) -> Iterator[Chunk]:
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
            self.empty,
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


def open_loader(spec: TrainSpec, split: str, world_size: int, rank: int, pin: bool) -> ShardLoader:
    """The loader of this rank's shard of ``split``, reading with ``spec.loader.reader``."""
    data, options = spec.data, spec.loader
    files = data.files.get(split, [])
    if options.reader == "petastorm":
        reader = PetastormReader(spec.store, data.path, data.columns, options.num_workers, files)
    else:
        reader = ArrowReader(spec.store, data.path, data.columns, options.num_workers)
    pieces = shard_pieces(files, world_size, rank)
    return ShardLoader(
        reader.chunks,
        pieces,
        _empty_chunk(spec, files, needs_shapes=not pieces),
        shuffle=options.shuffle and split == "train",
        shuffle_pieces=reader.keeps_order,
        buffer_rows=options.shuffle_buffer_size,
        seed=spec.seed,
        rank=rank,
        cache=options.inmemory_cache_all,
        pin_memory=pin,
    )


def _empty_chunk(spec: TrainSpec, files, needs_shapes: bool) -> Chunk:
    """Zero rows; with the real per-row shapes (one row read) for a rank with no rows."""
    if not files or not needs_shapes:
        return {c.name: torch.empty(0, dtype=c.torch_dtype) for c in spec.data.columns}
    path, groups = files[0]
    reader = ArrowReader(spec.store, spec.data.path, spec.data.columns, num_workers=1)
    one_row = reader.read(Piece(path, 0, 0, 1, groups[0]))
    return {name: t[:0] for name, t in one_row.items()}
