"""Executor: the shared memory a rank's decode workers decode into (``Segment``).

A segment is an anonymous memory file (``memfd_create``) by default: not a file in
``/dev/shm``, so not bound by that folder's size (64 MiB in a Docker container, and in a
Kubernetes pod without an ``emptyDir`` there), only by the memory the container may use. It
travels between processes as a descriptor (``Channel``) and is freed once its last
descriptor and mapping are gone, whatever ends the processes. Where
``SPARK_ESTIMATOR_SHM_DIR`` names a folder (a tmpfs of the user's choosing), a segment is a
file there instead, unlinked as soon as it is made. Either way its memory is reserved when
it is made (``posix_fallocate``), so that memory that runs out fails there, as ``ShmFull``,
and not later with a SIGBUS in the process that writes to it.

A segment's memory stays mapped while any tensor views it: ``close`` gives up the segment's
own descriptor and reference, and the mapping goes with the last view.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
from pathlib import Path

import torch

SHM_DIR_ENV = "SPARK_ESTIMATOR_SHM_DIR"
SEGMENT_NAME = "spark-estimator-decode"  # in a segment's mapping's name (/proc/PID/maps)


def shm_folder() -> str | None:
    """The folder segments are files in: ``SPARK_ESTIMATOR_SHM_DIR`` where set (or where
    anonymous memory files are not available: ``/dev/shm``, else the temporary folder);
    None for anonymous memory files."""
    if os.environ.get(SHM_DIR_ENV):
        return os.environ[SHM_DIR_ENV]
    if hasattr(os, "memfd_create"):
        return None
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def shm_place() -> str:
    """Where segments live, in words (for messages)."""
    folder = shm_folder()
    return f"files in {folder}" if folder else "anonymous memory files (memfd)"


def shm_free_bytes() -> int:
    """The bytes segments may take: the folder's free space, or for anonymous memory the
    memory available to this process (the machine's, within its cgroup's limit)."""
    folder = shm_folder()
    if folder:
        stat = os.statvfs(folder)
        return stat.f_bavail * stat.f_frsize
    return min(_meminfo_available(), _cgroup_headroom())


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def _cgroup_headroom() -> int:
    """What this process's memory cgroup may still take (v2, else v1), or a huge number."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return 1 << 62
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            folder = Path("/sys/fs/cgroup") / path.lstrip("/")
            limit, used = folder / "memory.max", folder / "memory.current"
        elif "memory" in controllers.split(","):
            folder = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            limit, used = folder / "memory.limit_in_bytes", folder / "memory.usage_in_bytes"
        else:
            continue
        try:
            cap = limit.read_text().strip()
            if cap != "max" and int(cap) < 1 << 60:
                return max(0, int(cap) - int(used.read_text()))
        except (OSError, ValueError):
            pass
    return 1 << 62


class ShmFull(OSError):
    """No room for a segment."""


class Segment:
    """Shared memory of ``size`` bytes, mapped here; ``fd`` is its descriptor (a new
    segment is made when ``fd`` is None: see the module)."""

    def __init__(self, size: int, fd: int | None = None):
        self.size = size
        if fd is None:
            fd = _new(size)
        self.fd = fd
        self.map: mmap.mmap | None = mmap.mmap(fd, size)

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor of ``dtype`` and ``shape`` at ``offset`` (a view of this memory, which
        keeps it mapped)."""
        count = int(torch.Size(shape).numel())
        if not count:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self.map, dtype=dtype, count=count, offset=offset).view(shape)

    def address(self) -> int:
        """Where its memory begins in this process."""
        return torch.frombuffer(self.map, dtype=torch.uint8, count=1).data_ptr()

    def close_fd(self) -> None:
        """Give up its descriptor, keeping the mapping (where another process has its own
        descriptor, or none needs one)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        """Give up this segment's descriptor and reference (its memory is unmapped when no
        tensor views it any more)."""
        self.close_fd()
        self.map = None


def _new(size: int) -> int:
    folder = shm_folder()
    if folder is None:
        fd = os.memfd_create(SEGMENT_NAME, os.MFD_CLOEXEC)
    else:
        fd, path = tempfile.mkstemp(prefix=f"{SEGMENT_NAME}-", dir=folder)
        os.unlink(path)  # freed once its last descriptor and mapping close
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            raise ShmFull(
                e.errno,
                f"{size / 2**20:.1f} MiB of shared memory in {shm_place()}, which has "
                f"{shm_free_bytes() / 2**20:.1f} MiB free",
            ) from e
        raise
    return fd
