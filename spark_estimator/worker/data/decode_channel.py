"""Executor: what a rank and its decode worker processes pass each other.

``Channel`` sends pickled messages over one end of a Unix socket pair, each with the file
descriptors it carries (``SCM_RIGHTS``): a worker hands its rank the shared memory it
decodes into as a descriptor of a file it has already unlinked, so nothing is left behind
by a process that dies, whatever kills it.

``Segment`` is such memory: a file in ``shm_dir()`` (``/dev/shm``, a tmpfs; else the
temporary folder), unlinked as soon as it is made and its blocks reserved
(``posix_fallocate``), so that a full tmpfs fails here with ``ShmFull`` instead of killing
the process that writes to it later (SIGBUS). ``shm_dir`` is ``SPARK_ESTIMATOR_SHM_DIR``
where set: another tmpfs where a container's ``/dev/shm`` is small.
"""

from __future__ import annotations

import errno
import mmap
import os
import pickle
import socket
import struct
import tempfile

import torch

SHM_DIR_ENV = "SPARK_ESTIMATOR_SHM_DIR"
_HEADER = struct.Struct("<QI")  # message bytes, descriptors
_MAX_FDS = 4


def shm_dir() -> str:
    """Where the decode workers' shared memory lives (see the module)."""
    if os.environ.get(SHM_DIR_ENV):
        return os.environ[SHM_DIR_ENV]
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def shm_free_bytes(folder: str | None = None) -> int:
    """The bytes free for an unprivileged writer in ``folder`` (``shm_dir()``)."""
    stat = os.statvfs(folder or shm_dir())
    return stat.f_bavail * stat.f_frsize


class ShmFull(OSError):
    """The shared memory folder has no room for a segment."""


class Segment:
    """Shared memory of ``size`` bytes, mapped here; ``fd`` is its descriptor (a new one
    is made when ``fd`` is None: see the module)."""

    def __init__(self, size: int, fd: int | None = None):
        self.size = size
        if fd is None:
            fd = _new_file(size)
        self.fd = fd
        self.map = mmap.mmap(fd, size)

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor of ``dtype`` and ``shape`` at ``offset`` (a view of this memory)."""
        count = int(torch.Size(shape).numel())
        if not count:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self.map, dtype=dtype, count=count, offset=offset).view(shape)

    def close(self) -> None:
        """Unmap and close it; a ``BufferError`` (nothing closed) while a tensor views it."""
        self.map.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _new_file(size: int) -> int:
    folder = shm_dir()
    fd, path = tempfile.mkstemp(prefix="spark-estimator-decode-", dir=folder)
    os.unlink(path)  # freed once its last descriptor and mapping close
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.ENOSPC, errno.EFBIG):
            raise ShmFull(
                e.errno,
                f"{size / 2**20:.1f} MiB of shared memory in {folder}, which has "
                f"{shm_free_bytes(folder) / 2**20:.1f} MiB free",
            ) from e
        raise
    return fd


class Channel:
    """Pickled messages, with file descriptors, over a connected Unix stream socket."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message, fds: tuple[int, ...] = ()) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        header = _HEADER.pack(len(data), len(fds))
        if fds:
            socket.send_fds(self.sock, [header], list(fds))
        else:
            self.sock.sendall(header)
        self.sock.sendall(data)

    def recv(self) -> tuple[object, list[int]]:
        """The next message and the descriptors it carried; EOFError when the other end
        closed."""
        header, fds, _, _ = socket.recv_fds(self.sock, _HEADER.size, _MAX_FDS)
        if not header:
            raise EOFError("the other end closed")
        header += self._exactly(_HEADER.size - len(header))
        length, count = _HEADER.unpack(header)
        if len(fds) != count:
            raise OSError(f"expected {count} file descriptors with a message, got {len(fds)}")
        return pickle.loads(self._exactly(length)), fds

    def _exactly(self, n: int) -> bytearray:
        out = bytearray(n)
        view, got = memoryview(out), 0
        while got < n:
            count = self.sock.recv_into(view[got:], n - got)
            if not count:
                raise EOFError("the other end closed")
            got += count
        return out

    def close(self) -> None:
        self.sock.close()
