"""Executor: what a rank, its decode workers and their fork server pass each other:
pickled messages over one end of a Unix socket pair, each with the file descriptors it
carries (``SCM_RIGHTS``: shared memory segments, a new worker's socket and pipes). The
descriptors received are close-on-exec, so that a process the rank starts does not
inherit them."""

from __future__ import annotations

import array
import pickle
import socket
import struct
import threading

_HEADER = struct.Struct("<QI")  # message bytes, descriptors
_MAX_FDS = 253  # the most one message carries (Linux's SCM_MAX_FD)
_FD = array.array("i")


class Channel:
    """Pickled messages, with file descriptors, over a connected Unix stream socket.
    Sending is thread-safe; one thread receives."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.sending = threading.Lock()

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message, fds: tuple[int, ...] = ()) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        header = _HEADER.pack(len(data), len(fds))
        with self.sending:
            if fds:
                socket.send_fds(self.sock, [header], list(fds))
                self.sock.sendall(data)
            else:  # one call (a message is small: a batch's bytes go through ``inbox``)
                self.sock.sendall(header + data)

    def recv(self) -> tuple[object, list[int]]:
        """The next message and the descriptors it carried; EOFError when the other end
        closed."""
        header, fds = self._header()
        if not header:
            raise EOFError("the other end closed")
        header += self._exactly(_HEADER.size - len(header))
        length, count = _HEADER.unpack(header)
        if len(fds) != count:
            raise OSError(f"expected {count} file descriptors with a message, got {len(fds)}")
        return pickle.loads(self._exactly(length)), fds

    def _header(self) -> tuple[bytes, list[int]]:
        """The next header's first bytes and the descriptors sent with it, received
        close-on-exec (``socket.recv_fds`` drops its ``flags``)."""
        size = socket.CMSG_LEN(_MAX_FDS * _FD.itemsize)
        data, ancillary, _, _ = self.sock.recvmsg(_HEADER.size, size, socket.MSG_CMSG_CLOEXEC)
        fds = array.array("i")
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
        return data, list(fds)

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
        """Close it (the other end reads EOF at once, whatever it was sent before)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
