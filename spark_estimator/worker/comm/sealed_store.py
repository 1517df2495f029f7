"""Executor: the job's key-value store, sealed under the launch's secret.

Rank 0's TCPStore answers anyone who reaches its port, and torch's store has no
authentication: such a client can list the keys, read every value, and write or delete any
key. So the secret of the launch (``rendezvous.Meeting``) never goes into the store, neither
as (part of) a key nor as a value; the ranks use it only as the key of what they write.
``SealedStore`` wraps the TCPStore client that the ranks and their process group use:

    stored value = nonce (16 random bytes) | ciphertext | tag (32 bytes)
    ciphertext   = value XOR HMAC-SHA256(encryption key, nonce | block number) ...
    tag          = HMAC-SHA256(authentication key, key name | nonce | ciphertext)

with both keys derived from the secret by HMAC-SHA256 (a pseudo-random function in counter
mode, then encrypt-then-MAC). A client of the port therefore reads random bytes: neither
the ranks' addresses (gloo's) nor NCCL's unique id. A value it writes, or one it copies
from another key, fails its tag, and the rank that reads it raises ``ForgedValue`` instead
of using it: the group does not form, the launch fails, and nobody connects to an address a
stranger gave. A fresh secret per launch keeps one launch's values from passing in another.

Not sealed: counters (``add``), which the server itself adds to (whether a rank already
failed, ``hvd.join``'s arrivals), and whether a key exists (``check``, ``wait``). A
stranger can change those, so it can make a launch fail or wait, but cannot feed a rank an
address or an id. The secret's own bytes never leave the process, so no error torch raises
about the store (a timeout names the keys it waited for) can contain them.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from datetime import timedelta

import torch.distributed as dist

_NONCE = 16
_TAG = hashlib.sha256().digest_size


class ForgedValue(RuntimeError):
    """A value in the job's store that no rank of this launch wrote under that key."""


def _derive(secret: str, purpose: bytes) -> bytes:
    return hmac.digest(secret.encode(), b"spark-estimator store " + purpose, "sha256")


class SealedStore(dist.Store):
    """``inner`` (a torch store) with its values encrypted and authenticated under
    ``secret`` (see the module); keys and counters pass through unchanged."""

    def __init__(self, inner: dist.Store, secret: str):
        super().__init__()
        self.inner = inner
        self._cipher = _derive(secret, b"encryption")
        self._mac = _derive(secret, b"authentication")
        self._counters: set[str] = set()  # keys this process added to: plain counts

    def _keystream(self, nonce: bytes, size: int) -> bytes:
        blocks = (size + _TAG - 1) // _TAG
        return b"".join(
            hmac.digest(self._cipher, nonce + i.to_bytes(8, "big"), "sha256") for i in range(blocks)
        )[:size]

    def _tag(self, key: str, nonce: bytes, sealed: bytes) -> bytes:
        name = key.encode()
        message = len(name).to_bytes(8, "big") + name + nonce + sealed
        return hmac.digest(self._mac, message, "sha256")

    def seal(self, key: str, value: bytes) -> bytes:
        nonce = os.urandom(_NONCE)
        size = len(value)
        stream = self._keystream(nonce, size)
        sealed = (int.from_bytes(value, "big") ^ int.from_bytes(stream, "big")).to_bytes(
            size, "big"
        )
        return nonce + sealed + self._tag(key, nonce, sealed)

    def open(self, key: str, stored: bytes) -> bytes:
        stored = bytes(stored)
        nonce, sealed, tag = stored[:_NONCE], stored[_NONCE:-_TAG], stored[-_TAG:]
        if len(stored) < _NONCE + _TAG or not hmac.compare_digest(
            tag, self._tag(key, nonce, sealed)
        ):
            raise ForgedValue(
                f"the job's store holds a value under key {key!r} that no rank of this launch "
                "wrote there (another process reached rank 0's TCPStore port); refused"
            )
        size = len(sealed)
        stream = self._keystream(nonce, size)
        return (int.from_bytes(sealed, "big") ^ int.from_bytes(stream, "big")).to_bytes(size, "big")

    # -- torch's Store interface (what gloo, NCCL and torch.distributed call) --------------
    def set(self, key: str, value) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(key, self.seal(key, value))

    def get(self, key: str) -> bytes:
        stored = self.inner.get(key)
        if key in self._counters:  # a count the server keeps (torch's store barrier)
            return stored
        return self.open(key, stored)

    def add(self, key: str, amount: int) -> int:
        self._counters.add(key)
        return self.inner.add(key, amount)

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
