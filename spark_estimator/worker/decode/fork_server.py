"""Executor: a rank's decode fork server, which forks the rank's decode worker processes
from itself.

A rank must not fork its workers (it may hold a CUDA context, threads and locks), and a new
interpreter for each worker costs a second or more to start and about 170 MiB of its own
memory (torch's, imported again). So the rank starts one clean process, ``python -m
spark_estimator.worker.decode.fork_server FD LABEL`` (FD its end of a Unix socket pair,
LABEL whose it is: ``rank-3``, what ``ps`` shows), which imports torch, gets the ``Recipe``
and builds the decoding once (the user's functions unpickled: their modules imported here),
answers ``ready`` (or ``failed`` with why), freezes its objects for the garbage collector
(so that a worker's collections do not write, and so copy, the pages it shares) and then,
for each ``("fork",)``, forks a worker: its socket pair and its stdout and stderr
pipes made here, the rank's ends sent to the rank with the worker's pid (``forked``). A
worker shares the server's pages until it writes them, so its own memory is what it
decodes, and it starts in milliseconds; ``decode_init_fn`` runs in each worker, not here.

The server stays single-threaded (forking a process with threads is unsafe), reaps its
workers and tells the rank how each ended (``exited``: ``os.waitpid``'s status), so the rank
can name a dead worker's signal. It ends when its rank closes the socket or dies: its
workers are asked to end by their sockets (closed by the rank), and those still running a
second later are killed; they are also killed by the kernel if the server dies
(``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import logging
import os
import pickle
import selectors
import signal
import socket
import sys
import time
import traceback

import torch

from .batch_decoding import BatchDecoding
from .channel import Channel
from .worker_process import describe, serve

PR_SET_PDEATHSIG = 1
GRACE_S = 1.0  # how long workers have to end by themselves once the server ends


def main(fd: int, label: str) -> None:
    name("decode-server")
    faulthandler.enable(all_threads=False)
    torch.set_num_threads(1)
    parent = os.getppid()
    channel = Channel(socket.socket(fileno=fd))
    (_, recipe), _ = channel.recv()
    try:
        decoding = BatchDecoding(pickle.loads(recipe))
    except BaseException as e:
        channel.send(("failed", describe(e)))
        return
    channel.send(("ready",))
    gc.freeze()
    children: set[int] = set()
    selector = selectors.DefaultSelector()
    selector.register(channel.sock, selectors.EVENT_READ)
    try:
        while os.getppid() == parent:
            if selector.select(0.5):
                try:
                    message, _ = channel.recv()
                except (EOFError, OSError):
                    break
                if message[0] != "fork":
                    break
                pid, fds = fork(decoding, channel, selector)
                children.add(pid)
                channel.send(("forked", pid), fds)
                for theirs in fds:
                    os.close(theirs)
            _reap(children, channel)
    finally:
        _end(children, channel)


def fork(decoding: BatchDecoding, server: Channel, selector) -> tuple[int, tuple]:
    """A worker forked; its pid and the rank's ends: its socket, its stdout and stderr."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    server_pid = os.getpid()
    pid = os.fork()
    if pid == 0:  # the worker
        code = 1
        try:
            _die_with(server_pid)
            selector.close()
            server.sock.close()
            ours.close()
            os.close(out_r)
            os.close(err_r)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            os.close(out_w)
            os.close(err_w)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the rank owns shutdown
            name("decode-worker")
            faulthandler.enable(all_threads=False)  # on its own stderr now: the decoding thread
            code = serve(Channel(theirs), decoding)
        except SystemExit as e:  # the user's code ended the worker: its status, as Python's
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(code)
    theirs.close()
    os.close(out_w)
    os.close(err_w)
    return pid, (ours.detach(), out_r, err_r)


def _reap(children: set[int], channel: Channel) -> None:
    """Tell the rank how each worker that ended did."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        try:
            channel.send(("exited", pid, status))
        except OSError:
            pass


def _end(children: set[int], channel: Channel) -> None:
    """Workers still running after ``GRACE_S`` killed (their rank closed their sockets),
    each reaped."""
    deadline = time.monotonic() + GRACE_S
    while children and time.monotonic() < deadline:
        _reap(children, channel)
        time.sleep(0.02)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in list(children):
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def _die_with(server: int) -> None:
    """Have the kernel kill this process when its parent, the fork server ``server``,
    ends."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != server:  # the server ended before the call above
        os._exit(0)


def name(title: str) -> None:
    """This process's name as ``ps -o comm`` and ``/proc/PID/comm`` show it."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(title[:15])
    except OSError:
        pass


if __name__ == "__main__":
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    main(int(sys.argv[1]), sys.argv[2])
