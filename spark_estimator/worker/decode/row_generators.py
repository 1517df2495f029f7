"""Executor: the rows' augmentation generators, ``np.random.default_rng([seed, epoch, row])``
for each row of a batch, made for the whole batch at once.

Made one at a time, such a generator costs about 10 us: NumPy's ``SeedSequence`` hashes
the three numbers into its pool, then ``PCG64`` draws its 128-bit state and increment from
the pool and steps twice. That is a tenth of a small JPEG's decoding in a decode worker.
``row_generators`` hashes a batch's rows on arrays instead (the same algorithm, in uint32
arithmetic) and seeds each row's ``PCG64`` with a seed sequence whose state is already
computed (``_RowSeed``): the same generators, bit for bit, at about a sixth of the cost,
which spawn the same children (``Generator.spawn``). It checks that against
NumPy's own seeding once per process (``_agrees``); where they differ (a NumPy whose
seeding changed) or a number does not fit 32 bits, each generator is made by
``default_rng``.
"""

from __future__ import annotations

import numpy as np
from numpy.random.bit_generator import ISpawnableSeedSequence

# NumPy's SeedSequence constants (numpy/random/bit_generator.pyx)
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R, _SHIFT = 0xCA01F9DD, 0x4973F715, 16
_POOL = 4  # uint32 words of the pool
_agreed: bool | None = None


def row_generators(seed: int, epoch: int, rows) -> list[np.random.Generator]:
    """``np.random.default_rng([seed, epoch, row])`` for each of ``rows`` (row indices)."""
    rows = np.asarray(rows, dtype=np.int64)
    if not len(rows):
        return []
    if not _fits(seed, epoch, rows) or not _agrees():
        return [np.random.default_rng([seed, epoch, int(r)]) for r in rows]
    return _seeded(seed, epoch, rows)


def _fits(seed: int, epoch: int, rows: np.ndarray) -> bool:
    """Whether each number is one uint32 word of entropy (larger ones are more words)."""
    limit = 2**32
    return 0 <= seed < limit and 0 <= epoch < limit and 0 <= rows.min() and rows.max() < limit


def _agrees() -> bool:
    """Whether ``_seeded`` gives NumPy's own generators here (checked once)."""
    global _agreed
    if _agreed is None:
        rows = np.array([0, 1, 77, 2**32 - 1], dtype=np.int64)
        ours = _seeded(2**31 + 5, 3, rows)
        _agreed = all(
            g.bit_generator.state
            == np.random.default_rng([2**31 + 5, 3, int(r)]).bit_generator.state
            for g, r in zip(ours, rows)
        )
    return _agreed


class _RowSeed(ISpawnableSeedSequence):
    """Row ``row``'s ``SeedSequence([seed, epoch, row])`` with its pool's state already
    computed (``words``: ``generate_state(4, np.uint64)``, which is all PCG64 asks for): it
    spawns the children NumPy's spawns (``Generator.spawn``), and gives any other state as
    NumPy's."""

    __slots__ = ("entropy", "n_children_spawned", "words")
    spawn_key = ()
    pool_size = _POOL

    def __init__(self, entropy: list[int], words: np.ndarray, n_children_spawned: int = 0):
        self.entropy, self.words, self.n_children_spawned = entropy, words, n_children_spawned

    def generate_state(self, n_words, dtype=np.uint32) -> np.ndarray:
        if n_words == 4 and np.dtype(dtype) == np.uint64:
            return self.words
        return np.random.SeedSequence(self.entropy).generate_state(n_words, dtype)

    def spawn(self, n_children: int) -> list[np.random.SeedSequence]:
        first = self.n_children_spawned
        self.n_children_spawned += n_children
        return [
            np.random.SeedSequence(self.entropy, spawn_key=(i,), pool_size=_POOL)
            for i in range(first, first + n_children)
        ]

    def __reduce__(self):
        return _RowSeed, (self.entropy, self.words, self.n_children_spawned)


def _seeded(seed: int, epoch: int, rows: np.ndarray) -> list[np.random.Generator]:
    words = _pool_state(seed, epoch, rows)  # [rows, 4] uint64: PCG64's seeding
    pcg64, generator = np.random.PCG64, np.random.Generator
    return [
        generator(pcg64(_RowSeed([seed, epoch, row], w))) for row, w in zip(rows.tolist(), words)
    ]


def _pool_state(seed: int, epoch: int, rows: np.ndarray) -> np.ndarray:
    """Each row's ``SeedSequence([seed, epoch, row]).generate_state(4, np.uint64)``."""
    u32 = np.uint32
    entropy = [np.full(len(rows), seed, u32), np.full(len(rows), epoch, u32), rows.astype(u32)]
    entropy.append(np.zeros(len(rows), u32))  # the pool's fourth word: hashmix(0)
    const = u32(_INIT_A)

    def hashmix(value: np.ndarray) -> np.ndarray:
        nonlocal const
        value = value ^ const
        const = u32(const * u32(_MULT_A))
        value = value * const
        return value ^ (value >> u32(_SHIFT))

    with np.errstate(over="ignore"):  # uint32 arithmetic wraps, as in C
        pool = [hashmix(e) for e in entropy]
        for src in range(_POOL):
            for dst in range(_POOL):
                if src != dst:
                    mixed = u32(_MIX_L) * pool[dst] - u32(_MIX_R) * hashmix(pool[src])
                    pool[dst] = mixed ^ (mixed >> u32(_SHIFT))
        state = np.empty((len(rows), 2 * _POOL), u32)
        const = u32(_INIT_B)
        for i in range(2 * _POOL):  # 8 uint32 words cycling over the pool
            value = pool[i % _POOL] ^ const
            const = u32(const * u32(_MULT_B))
            value = value * const
            state[:, i] = value ^ (value >> u32(_SHIFT))
    return state.view("<u8")
