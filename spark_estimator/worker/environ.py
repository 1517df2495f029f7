"""Executor: environment variables set for the length of a block, then put back.

PySpark reuses its Python workers from task to task, so what a task sets in ``os.environ``
(``run``'s ``env``, the torchrun-style variables of a script) must not leak into the next.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


@contextmanager
def environ(updates: Mapping[str, str]) -> Iterator[None]:
    """Set ``updates`` in ``os.environ`` inside the block; restore the previous values (or
    their absence) after it."""
    before = {name: os.environ.get(name) for name in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
