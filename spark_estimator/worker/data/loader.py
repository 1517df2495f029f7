"""Executor: one rank's shard of a split as batches of tensors, seeded and exact.

A pass reads the rank's pieces (row-group slices, see ``shard_pieces``) through a reader that
prefetches in the background, and cuts them into batches of the sizes the step plan asks
for, so every row of the shard is in exactly one batch per pass. With ``shuffle`` the piece
order is permuted per pass, and rows go through a bounded shuffle buffer: the buffer is
refilled to ``buffer_rows`` rows, each refill permuted, and half of it kept for the next
(the ``shuffle`` module: the refills follow the buffer's size, not the batch sizes, so the order is
the same however a pass is cut), so every row is copied about twice, never once per batch.
The permutations come from a generator seeded by (seed, pass, rank): the same seed gives
the same batches, and each pass a different order. With ``cache`` the shard's pieces stay
in memory after the first pass. On a GPU the buffer lives in pinned memory so batches copy
without blocking. Chunks, the buffer and batches are ``Columns`` (``worker.data.columns``): the
scalar columns of one dtype as one row-major ``[rows, columns]`` block, laid out in the
reader threads as each piece is read (their one copy; other columns stay in the reader's
memory), so the shuffle moves whole rows and a batch is one view per block. Each refill is
planned from the pieces' row counts, so its permutation is drawn first and every chunk is
copied into place as it arrives while the reader threads read the next. A batch reads as a
Mapping of column name to tensor. With length bucketing (``Bucketing``) each shuffle
window's served rows are then regrouped by length, in place in the buffer, still
independently of the batch sizes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from functools import partial

import numpy as np
import torch

from ...shared.spec import ColumnSpec, DatasetInfo, TrainSpec
from .arrow_reader import ROW_ID, ArrowReader, row_offsets
from .binary_rows import BinaryRows
from .buckets import BUCKET_BATCHES, Bucketing, measured_columns
from .columns import Columns, Layout, place
from .convert import BINARY_ROWS, Tensors, as_tensor, object_bytes, read_only_arrays
from .device_shard import DeviceShard
from .petastorm_reader import PetastormReader
from .shards import Piece, even_pieces, pass_generator, piece_order, shard_pieces
from .shuffle import default_buffer_rows, windows


def _refill(parts: Iterable[Columns], rows: int, perm: torch.Tensor | None, pin: bool) -> Columns:
    """The ``rows`` rows of ``parts`` (chunks, or what is left of the buffer) in new
    tensors, one per block and other column, in the order ``perm``
    (``pool[i] = rows[perm[i]]``; None: as they come).

    Each part is copied into place as it arrives (the reader threads meanwhile read and lay
    out the next ones): one indexed copy of whole rows per block (``place``), with the
    inverse permutation (drawn in NumPy: torch's indexed assignment runs on its intra-op
    threads, which then spin for milliseconds, measured 120-160 us of CPU a 64-row batch
    on 2 cores). The result never shares memory with the parts, so a batch edited in place
    cannot change cached chunks.
    """
    inverse = None
    if perm is not None:
        order = perm.numpy()
        inverse_np = np.empty_like(order)
        inverse_np[order] = np.arange(rows, dtype=order.dtype)
        inverse = torch.from_numpy(inverse_np)
    pool, at = None, 0
    for part in parts:
        if pool is None:
            pool = part.layout.allocate(rows, part, pin)
        n = part.rows
        for target, source in zip(pool.parts(), part.parts()):
            if inverse is None:
                place(target[at : at + n], source)
            else:
                place(target, source, inverse[at : at + n])
        at += n
    if pool is not None:  # kept rows of many chunks no longer keep all of those chunks
        pool.raws = [r.compacted() if isinstance(r, BinaryRows) else r for r in pool.raws]
    return pool


class Counted(Iterator):
    """``items``, ``count`` of them, saying how many are left to come
    (``operator.length_hint``: the decode pool spreads a pass's last batches over its
    workers by it)."""

    def __init__(self, items: Iterator, count: int):
        self.items, self.left = items, count

    def __next__(self):
        item = next(self.items)
        self.left -= 1
        return item

    def __length_hint__(self) -> int:
        return max(0, self.left)


def buffered_batches(
    chunks: Iterable[Columns],
    sizes: list[int],
    layout: Layout,
    rows_of_chunks: list[int],
    *,
    buffer_rows: int | None,
    generator: torch.Generator | None,
    pin_memory: bool = False,
    regroup: Callable[[Columns, int], None] | None = None,
) -> Iterator[Columns]:
    """Cut a stream of chunks (``layout.assemble``'s, of ``rows_of_chunks`` rows each) into
    batches of ``sizes`` rows.

    Without a generator rows keep their order. With one, rows pass through a shuffle buffer
    of ``buffer_rows`` rows (``None``: about 256 MiB worth, sized from the first chunk),
    refilled as ``shuffle.windows`` says: the order does not depend on ``sizes``. The pool
    (the buffer in memory) is refilled when the next batch is not yet in it: its first
    ``ready`` rows are the rows to serve, in order, the rest the buffer's kept rows. Each
    refill is planned from ``rows_of_chunks`` (so its permutation is drawn before its
    chunks arrive, and each is copied into place as it comes); ``layout.empty`` stands for
    an empty shard's batches. After a refill, every batch that the pool holds is cut in one
    ``split`` per block and other column. With a generator and ``regroup`` (length
    bucketing, ``buckets.Bucketing``), each window's served rows, all in the refill that
    takes the window, are reordered in place by ``regroup(rows, window index)``.
    """
    chunks = iter(chunks)
    pool, cursor, ready = layout.empty, 0, 0  # rows [cursor, ready) of pool: next served
    taken, plan = 0, None  # chunks taken so far; the shuffle's windows
    windows_taken = 0  # the index in the pass of the next window (regroup's)

    def arriving(start: int, count: int, first: Columns | None) -> Iterator[Columns]:
        for k in range(count):
            chunk = first if k == 0 and first is not None else next(chunks, None)
            yield _as_planned(chunk, rows_of_chunks[start + k])

    i = 0
    while i < len(sizes):
        if ready - cursor < sizes[i] and taken < len(rows_of_chunks):
            first = None
            if generator is not None and plan is None:
                if buffer_rows is None:  # sized by the first chunk
                    first = _as_planned(next(chunks, None), rows_of_chunks[0])
                    buffer_rows = default_buffer_rows(row_bytes(first))
                plan = windows(rows_of_chunks, buffer_rows, generator)
            left = pool.rows - cursor
            at = ready - cursor  # the first row that this refill's windows serve
            count, ready, perm, serves = _plan_refill(
                rows_of_chunks, taken, sizes[i], left, at, plan
            )
            leftover = [pool.narrow(cursor, left)] if left else []
            parts = itertools.chain(leftover, arriving(taken, count, first))
            rows = left + sum(rows_of_chunks[taken : taken + count])
            pool, cursor, taken = _refill(parts, rows, perm, pin_memory), 0, taken + count
            for serve in serves if regroup is not None else ():
                regroup(pool.narrow(at, serve), windows_taken)
                at, windows_taken = at + serve, windows_taken + 1
        j, take = i, 0  # batches i..j-1 come from this pool
        while j < len(sizes) and sizes[j] <= ready - cursor - take:
            take += sizes[j]
            j += 1
        if j == i:
            raise RuntimeError(
                f"loader: the shard ran out of rows ({ready - cursor} left for a batch of "
                f"{sizes[i]}); did the dataset change while training?"
            )
        yield from pool.narrow(cursor, take).split(sizes[i:j])
        cursor, i = cursor + take, j


def _plan_refill(
    rows_of_chunks: list[int], taken: int, size: int, left: int, ready: int, plan
) -> tuple[int, int, torch.Tensor | None, list[int]]:
    """The next pool: (chunks to add, rows ready to serve, its order as positions in the
    concatenation of the ``left`` rows of the pool, ``ready`` of them in served order, and
    the chunks; None: that concatenation as it is; the rows each window taken serves, which
    follow the ``ready`` rows in the pool, in window order). Chunks come until ``size`` rows
    are ready or none are left: a window of ``plan`` at a time, or (no shuffle) one by one."""
    count, serves = 0, []
    if plan is None:
        while ready < size and taken + count < len(rows_of_chunks):
            ready += rows_of_chunks[taken + count]
            count += 1
        return count, ready, None, serves
    # the pool's rows: `ready` in order, then the kept ones, the range [ready, left); the
    # chunks follow them, so kept and new rows are one range until a window serves some
    parts, held, first_held, total = [torch.arange(ready)], None, ready, left
    while ready < size:
        window = next(plan, None)
        if window is None:
            break
        new = sum(rows_of_chunks[taken + count : taken + count + window.chunks])
        count += window.chunks
        if held is None:  # (first_held .. total + new)[perm], without gathering
            held = window.perm + first_held if first_held else window.perm
        else:
            held = torch.cat([held, torch.arange(total, total + new)])[window.perm]
        total += new
        parts.append(held[: window.serve])
        held = held[window.serve :]
        ready += window.serve
        serves.append(window.serve)
    parts.append(torch.arange(first_held, total) if held is None else held)
    parts = [p for p in parts if len(p)]
    perm = parts[0] if len(parts) == 1 else torch.cat([torch.arange(0), *parts])
    return count, ready, perm, serves


def _as_planned(chunk: Columns | None, expected: int) -> Columns:
    got = "no" if chunk is None else chunk.rows
    if got != expected:
        raise RuntimeError(
            f"loader: the reader gave {got} rows for a piece of {expected}; "
            "did the dataset change while training?"
        )
    return chunk


def row_bytes(chunk: Columns) -> int:
    """The bytes of one of ``chunk``'s rows (1 for no rows); a variable column's from its
    first rows' sizes."""
    rows = chunk.rows
    if not rows:
        return 1
    raw = sum(object_bytes(r[:64]) * rows // min(rows, 64) for r in chunk.raws)
    return (sum(t.nbytes for t in chunk.tensors()) + raw) // rows


class ShardLoader:
    """Batches of one rank's pieces of one split, pass after pass.

    ``read_chunks(pieces)`` yields one chunk per piece in the order given, laid out by
    ``layout.assemble`` (a reader's ``chunks``, assembling in its threads);
    ``shuffle_pieces`` is False for readers that can only go in file order. With
    ``bucket`` (and ``shuffle``), each shuffle window's served rows are regrouped by length
    (``Bucketing``).
    """

    def __init__(
        self,
        read_chunks: Callable[[list[Piece]], Iterator[Columns]],
        pieces: list[Piece],
        layout: Layout,
        *,
        shuffle: bool,
        shuffle_pieces: bool,
        buffer_rows: int | None,
        seed: int,
        rank: int,
        cache: bool,
        pin_memory: bool,
        bucket: Bucketing | None = None,
    ):
        self.read_chunks, self.pieces, self.layout = read_chunks, pieces, layout
        self.bucket = bucket if shuffle else None
        self.shuffle, self.shuffle_pieces, self.buffer_rows = shuffle, shuffle_pieces, buffer_rows
        self.seed, self.rank, self.pin_memory = seed, rank, pin_memory
        self.cache: dict[Piece, Columns] | None = {} if cache else None
        self.rows = sum(p.rows for p in pieces)

    def batches(self, sizes: list[int], pass_index: int) -> Iterator[Columns]:
        """One pass: batches of ``sizes`` rows (summing to the shard's rows), an iterator
        that knows how many are left (``Counted``)."""
        return Counted(self._batches(sizes, pass_index), len(sizes))

    def _batches(self, sizes: list[int], pass_index: int) -> Iterator[Columns]:
        if sum(sizes) > self.rows:
            raise ValueError(f"loader: {sum(sizes)} rows asked of a shard of {self.rows}")
        generator = pass_generator(self.seed, pass_index, self.rank) if self.shuffle else None
        permute = generator if self.shuffle_pieces else None
        order = [self.pieces[i] for i in piece_order(self.pieces, permute)]
        regroup = None
        if self.bucket is not None:
            bucket = self.bucket

            def regroup(rows: Columns, window: int) -> None:
                bucket.regroup(rows, pass_index, window)

        yield from buffered_batches(
            self._chunks(order),
            sizes,
            self.layout,
            [p.rows for p in order],
            buffer_rows=self.buffer_rows,
            generator=generator,
            pin_memory=self.pin_memory,
            regroup=regroup,
        )

    def _chunks(self, order: list[Piece]) -> Iterator[Columns]:
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
    share: Callable[[Columns], Columns] | None = None,
) -> ShardLoader | DeviceShard:
    """The loader of this rank's shard of ``split``, reading with ``spec.loader.reader``;
    with ``hold_on``, the whole shard read once into that device's memory instead; with
    ``share``, each chunk laid out is handed to it in the reader threads (the decode
    workers' ``SharedRows.share``: its bytes read straight into shared memory)."""
    data, options = spec.data, spec.loader
    files = data.files.get(split, [])
    if options.reader == "petastorm":
        reader = PetastormReader(spec.store, data.path, data.columns, options.num_workers, files)
    else:
        offsets = row_offsets(files) if data.variable else None
        columns = read_columns(data)
        reader = ArrowReader(
            spec.store, data.path, columns, options.num_workers, offsets, data.in_place, split
        )
    pieces = shard_pieces(files, world_size, rank)
    if data.in_place is not None:
        pieces = even_pieces(pieces, data.in_place.row_group_bytes())
    template = _template(spec, files, needs_shapes=not pieces, split=split)
    shuffle = options.shuffle and split == "train"
    if hold_on is not None:
        return DeviceShard(
            reader.chunks,
            pieces,
            template,
            data.columns,
            shuffle=shuffle,
            shuffle_pieces=reader.keeps_order,
            buffer_rows=options.shuffle_buffer_size,
            seed=spec.seed,
            rank=rank,
            device=hold_on,
        )
    layout = Layout(template, data.columns)
    bucket = None
    measured = measured_columns(data.features + data.labels)
    if shuffle and options.decode is not None and options.decode.bucket_by_length and measured:
        group = BUCKET_BATCHES * spec.batch_size
        bucket = Bucketing(measured, group, spec.seed, rank)
    prepare = layout.assemble
    if share is not None:

        def prepare(chunk: dict) -> Columns:
            return share(layout.assemble(chunk))

    return ShardLoader(
        partial(reader.chunks, prepare=prepare),
        pieces,
        layout,
        shuffle=shuffle,
        shuffle_pieces=reader.keeps_order,
        buffer_rows=options.shuffle_buffer_size,
        seed=spec.seed,
        rank=rank,
        cache=options.inmemory_cache_all,
        pin_memory=pin,
        bucket=bucket,
    )


def empty_batch(spec: TrainSpec, split: str) -> Tensors:
    """A batch of zero rows of ``split``, its columns in their dtypes and row shapes."""
    return _template(spec, spec.data.files.get(split, []), needs_shapes=True, split=split)


def read_columns(data: DatasetInfo) -> list[ColumnSpec]:
    """The columns a rank reads: the data's, and the rows' names where there are any
    (``DatasetInfo.row_names``: named in decoding errors)."""
    names = [ColumnSpec(data.row_names, "string", "float32")] if data.row_names else []
    return data.columns + names


def _template(spec: TrainSpec, files, needs_shapes: bool, split: str = "train") -> dict:
    """Zero rows of every column in its dtype (an empty object array for a variable column,
    and the rows' indices where there are variable columns); with the real row shapes (one
    row read) for a rank without rows, whose empty batches still go through forward()."""
    columns = read_columns(spec.data)
    fixed = [c for c in columns if not c.variable]
    template = {c.name: _no_rows(c) for c in columns if c.variable}
    if spec.data.variable:
        template[ROW_ID] = torch.empty(0, dtype=torch.int64)
    first = _first_piece(files, 1) if needs_shapes else None
    if first is None:
        return {**{c.name: torch.empty(0, dtype=c.torch_dtype) for c in fixed}, **template}
    reader = ArrowReader(spec.store, spec.data.path, fixed, 1, None, spec.data.in_place, split)
    one_row = reader.read(first)
    with read_only_arrays():
        shaped = {c.name: as_tensor(one_row[c.name][:0], c.torch_dtype) for c in fixed}
    return {**shaped, **template}


def _no_rows(column: ColumnSpec) -> np.ndarray | BinaryRows:
    """Zero rows of a variable column, held as the reader holds them (``variable_rows``)."""
    if column.kind in BINARY_ROWS:
        return BinaryRows.empty(text=column.kind == "string")
    return np.empty(0, dtype=object)


def first_rows(spec: TrainSpec, split: str, rows: int = 1) -> Columns | None:
    """The first ``rows`` rows of ``split`` as the loader lays them out (None: no rows)."""
    files = spec.data.files.get(split, [])
    first = _first_piece(files, rows)
    if first is None:
        return None
    columns = read_columns(spec.data)
    in_place = spec.data.in_place
    reader = ArrowReader(
        spec.store, spec.data.path, columns, 1, row_offsets(files), in_place, split
    )
    chunk = reader.read(first)
    template = _template(spec, [], needs_shapes=False)
    return Layout(template, spec.data.columns).assemble(chunk)


def _first_piece(files: list[tuple[str, list[int]]], rows: int) -> Piece | None:
    """The first ``rows`` rows (at most a row group's) of the first row group that holds
    any of the split's; None where none does."""
    for path, groups in files:
        for group, count in enumerate(groups):
            if count:
                return Piece(path, group, 0, min(rows, count), count)
    return None
