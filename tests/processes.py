"""The processes a test started, told from those of the pytest worker beside it."""

from __future__ import annotations

import os
from pathlib import Path

TOKEN = "SPARK_ESTIMATOR_TEST_PROCESS"  # set by tests/conftest.py to the pytest process's pid
SERVER = "decode.fork_server"  # the command line of a fork server and of its workers


def decode_workers(label: str = "", kind: str = "") -> dict[int, str]:
    """pid -> command line of the decode processes (the ranks' fork servers, ``kind``
    "server", and the workers forked from them, ``kind`` "worker"; both without ``kind``)
    that this pytest process started, directly or through Spark, whose command line holds
    ``label``."""
    mine = f"{TOKEN}={os.environ[TOKEN]}".encode()
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            if SERVER not in args or label not in args:
                continue
            comm = (proc / "comm").read_text().strip()
            if kind and not comm.startswith(f"decode-{kind}"):
                continue
            if _zombie(proc) or mine not in (proc / "environ").read_bytes().split(b"\0"):
                continue
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # ended meanwhile
        found[int(proc.name)] = args
    return found


def _zombie(proc: Path) -> bool:
    return (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
