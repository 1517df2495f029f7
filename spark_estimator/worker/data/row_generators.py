"""Executor: the rows' augmentation generators, ``np.random.default_rng([seed, epoch, row])``
for each row of a batch, made for the whole batch at once.

Made one at a time, such a generator costs about 10 us: NumPy's ``SeedSequence`` hashes
the three numbers into its pool, then ``PCG64`` draws its 128-bit state and increment from
the pool and steps twice. That is a tenth of a small JPEG's decoding in a decode worker.
``row_generators`` hashes a batch's rows on arrays instead (the same algorithm, in uint32
arithmetic) and gives each row's ``PCG64`` the state that seeding would have given it:
the same generators, bit for bit, at about a third of the cost. It checks that against
NumPy's own seeding once per process (``_agrees``); where they differ (a NumPy whose
seeding changed) or a number does not fit 32 bits, each generator is made by
``default_rng``.
"""

from __future__ import annotations

import numpy as np
from numpy.random.bit_generator import ISeedSequence

# NumPy's SeedSequence constants (numpy/random/bit_generator.pyx)
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R, _SHIFT = 0xCA01F9DD, 0x4973F715, 16
_POOL = 4  # uint32 words of the pool
# PCG64's multiplier (numpy/random/src/pcg64/pcg64.h: PCG_DEFAULT_MULTIPLIER_128)
_PCG_MULT = (2549297995355413924 << 64) | 4865540595714422341
_MASK128 = (1 << 128) - 1
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


class _Words(ISeedSequence):
    """A seed sequence whose state is given: a PCG64 made from it costs next to nothing,
    its state set afterwards."""

    def generate_state(self, n_words, dtype=np.uint32):
        return np.zeros(n_words, dtype)


_WORDS = _Words()


def _seeded(seed: int, epoch: int, rows: np.ndarray) -> list[np.random.Generator]:
    words = _pool_state(seed, epoch, rows).tolist()  # [rows, 4] uint64: PCG64's seeding
    out = []
    for seed_hi, seed_lo, inc_hi, inc_lo in words:
        # pcg_setseq_128_srandom_r: state 0, inc odd, step, add the seed, step
        inc = ((((inc_hi << 64) | inc_lo) << 1) | 1) & _MASK128
        state = (inc + ((seed_hi << 64) | seed_lo)) & _MASK128
        state = (state * _PCG_MULT + inc) & _MASK128
        bits = np.random.PCG64(_WORDS)
        bits.state = {
            "bit_generator": "PCG64",
            "state": {"state": state, "inc": inc},
            "has_uint32": 0,
            "uinteger": 0,
        }
        out.append(np.random.Generator(bits))
    return out


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
