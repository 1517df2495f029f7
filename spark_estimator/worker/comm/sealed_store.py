"""Executor: the job's key-value store, sealed under the launch's secret.

Rank 0's TCPStore answers anyone who reaches its port, and torch's store has no
authentication: such a client can list the keys, read every value, and write or delete any
key. So the secret of the launch (``meeting.Meeting``) never goes into the store, neither
as (part of) a key nor as a value; the ranks use it only as the key of what they write.
``SealedStore`` wraps the TCPStore client that the ranks and their process group use, and
seals every value with an AEAD from ``cryptography``:

    stored value = "~" | nonce (12 random bytes) | ChaCha20-Poly1305(key, nonce, value, key name)

the key derived from the secret by HKDF-SHA256, the key name as associated data. A client
of the port therefore reads random bytes: neither the ranks' addresses (gloo's) nor NCCL's
unique id. A value it writes, or one it copies from another key, fails its tag, and the
rank that reads it raises ``ForgedValue`` instead of using it: the group does not form, the
launch fails, and nobody connects to an address a stranger gave. A fresh secret per launch
keeps one launch's values from passing in another.

Counters (``add``) are sealed values too, counted by the ranks with ``compare_set`` (a
sealed count is no number to the server, which refuses a stranger's ``add`` to it: the server
reads a number from a value's leading digits, which the "~" before the random nonce never
are). With a
plain count a stranger could set one (a rank would believe that another rank failed first)
or make it no number (torch's server drops the connection of every rank that adds to it).
Now a count a stranger wrote raises ``ForgedValue``, and the rank's connection stays open;
``meeting.first_failure`` replaces it (``replace_forged``) to claim the job's first
failure. Not sealed: whether a key exists (``check``, ``wait``, ``delete_key``): a stranger
can still make a launch fail or wait, or replay an earlier value of the same key of this
launch, but not feed a rank an address, an id or a count of its own. The secret's own bytes
never leave the process, so no error torch raises about the store can contain them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

_NONCE = 12  # ChaCha20-Poly1305's; random per value
_MARK = b"~"  # before the nonce: no digit, sign or space, so no sealed value reads as a number
_PURPOSE = b"spark-estimator store: ChaCha20-Poly1305"  # HKDF's info: what the key is for


class ForgedValue(RuntimeError):
    """A value in the job's store that no rank of this launch wrote under that key."""


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class SealedStore(dist.Store):
    """``inner`` (a torch store) with its values, counters included, encrypted and
    authenticated under ``secret`` (see the module); keys pass through unchanged."""

    def __init__(self, inner: dist.Store, secret: str | None, *, _aead=None):
        super().__init__()
        self.inner = inner
        if _aead is None:
            key = HKDF(hashes.SHA256(), 32, None, _PURPOSE).derive(secret.encode())
            _aead = ChaCha20Poly1305(key)
        self._aead = _aead
        # expected and desired value of compare_set to read a key without waiting for it:
        # random, so never stored (a stranger cannot learn it)
        self._absent = os.urandom(16)

    def seal(self, key: str, value: bytes) -> bytes:
        nonce = os.urandom(_NONCE)
        return _MARK + nonce + self._aead.encrypt(nonce, value, key.encode())

    def open(self, key: str, stored: bytes) -> bytes:
        stored = bytes(stored)
        nonce, sealed = stored[len(_MARK) : len(_MARK) + _NONCE], stored[len(_MARK) + _NONCE :]
        try:
            if not stored.startswith(_MARK):
                raise ValueError("no mark")
            return self._aead.decrypt(nonce, sealed, key.encode())
        except (InvalidTag, ValueError):  # ValueError: too short for a nonce and a tag
            raise ForgedValue(
                f"the job's store holds a value under key {key!r} that no rank of this launch "
                "wrote there (another process reached rank 0's TCPStore port); refused"
            ) from None

    def _stored(self, key: str) -> bytes | None:
        """``key``'s stored bytes, None where it is absent (without waiting for it)."""
        got = self.inner.compare_set(key, self._absent, self._absent)
        return None if got == self._absent else got

    def _update(self, key: str, change: Callable, replace_forged: bool = False):
        """Change ``key``'s value atomically: ``change(plaintext or None)`` gives (the new
        plaintext or None to leave it, the result); the sealed value is swapped in with
        ``compare_set`` against the bytes read, again where another rank came first."""
        stored = self._stored(key)
        while True:
            try:
                current = None if stored is None else self.open(key, stored)
            except ForgedValue:
                if not replace_forged:
                    raise
                current = None
            value, result = change(current)
            if value is None:
                return result
            sealed = self.seal(key, value)
            got = self.inner.compare_set(key, b"" if stored is None else stored, sealed)
            if got == sealed:
                return result
            # torch answers an absent key with the expected value
            stored = None if stored is not None and got == stored else got

    # -- torch's Store interface (what gloo, NCCL and torch.distributed call) --------------
    def set(self, key: str, value) -> None:
        self.inner.set(key, self.seal(key, _bytes(value)))

    def get(self, key: str) -> bytes:
        return self.open(key, self.inner.get(key))

    def add(self, key: str, amount: int, replace_forged: bool = False) -> int:
        """Add to ``key``'s count (absent: 0) and return it; ``ForgedValue`` where a
        stranger wrote the key, unless ``replace_forged`` (then its count starts at 0)."""

        def count(current):
            total = amount + (0 if current is None else _count(key, current))
            unchanged = current is not None and amount == 0  # a read (torch's barrier)
            return (None if unchanged else str(total).encode()), total

        return self._update(key, count, replace_forged)

    def compare_set(self, key: str, expected, desired) -> bytes:
        """torch's compare_set on plaintexts: ``desired`` where ``key`` held ``expected``
        (absent: ``b""``), else the value it holds (absent: ``expected``)."""
        expected, desired = _bytes(expected), _bytes(desired)

        def swap(current):
            if current is None:
                return (None, expected) if expected else (desired, desired)
            return (desired, desired) if current == expected else (None, current)

        return self._update(key, swap)

    def append(self, key: str, value) -> None:
        value = _bytes(value)
        self._update(key, lambda current: ((current or b"") + value, None))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def multi_set(self, keys: list[str], values: list) -> None:
        for key, value in zip(keys, values, strict=True):  # one by one, not atomically
            self.set(key, value)

    def clone(self) -> SealedStore:
        """Another connection to the same store, under the same secret."""
        return SealedStore(self.inner.clone(), None, _aead=self._aead)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)


def _count(key: str, value: bytes) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"add: key {key!r} of the job's store holds {value!r}, not a count"
        ) from None
