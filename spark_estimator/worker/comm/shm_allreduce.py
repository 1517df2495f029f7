"""Executor: gradient averaging through shared memory, when every rank is a CPU process on
one host.

gloo sums tensors over TCP sockets, even between processes of one machine: on a small
VM a 300 KB gradient bucket takes 1-4 ms per step that way, more than the step's compute
for a small model. When all ranks are CPU processes on one Linux x86-64 host, DDP's
gradient buckets go through one memory-mapped file under ``/dev/shm`` instead
(``SharedMemoryAllreduce``, run by the DDP communication hook ``shared_memory_allreduce``):
each rank copies its bucket into its own slot, publishes a sequence number, waits for everyone's,
and sums the slots in rank order, so every rank computes bitwise the same average. Two
sets of slots are used in turn, so a rank never overwrites a slot that a slower rank may
still be reading. Buckets larger than a slot go through in chunks.

Setting it up is a collective over the process group: rank 0 creates the file (space
reserved up front, so a full ``/dev/shm`` fails here, not later) and every rank maps it;
if any rank cannot (another host, another ``/dev/shm``, a peer process it cannot see, not
Linux x86-64, where stores are not seen in program order without fences), every rank uses
gloo. The file is unlinked as soon as all ranks have mapped it, so nothing is left behind.

Waits are bounded: a peer process that died is noticed within ``LIVENESS_S`` (its pid is
gone from ``/proc``), as is one that closed its mapping while alive (its training failed
and the process lives on as Spark's reused Python worker: ``close`` marks its pid slot
``LEFT``), and a peer that hangs after ``timeout_s``; all raise a
``RuntimeError`` tagged ``SHM_TAG``, which ``is_peer_failure`` counts as a peer failure, as it
does gloo's "connection closed" errors.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import time

import numpy as np
import torch
import torch.distributed as dist

from ...shared.failures import SHM_TAG

SLOT_BYTES = 1 << 20  # per rank and set of slots: 2 x world x 1 MiB in all
LIVENESS_S = 0.5  # how often a waiting rank checks that its peers still live
# the file: a header of int64 words, per rank its arrive and done sequence numbers and its
# pid (padded to a page), then two sets of one slot per rank
_SPIN = 200  # waits that only yield the CPU before sleeping between checks
LEFT = -1  # a rank's pid word once it has closed the mapping


def shm_folder() -> str | None:
    """Where the shared file goes: ``/dev/shm`` on Linux x86-64, else None (not used)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class SharedMemoryAllreduce:
    """The ranks' shared slots. Use ``open`` (a collective), then ``average_`` per bucket
    on every rank in the same order, then ``close``."""

    def __init__(self, mapped: mmap.mmap, rank: int, world: int, timeout_s: float):
        self.mapped, self.rank, self.world, self.timeout_s = mapped, rank, world, timeout_s
        header_bytes = _header_bytes(world)
        words = np.frombuffer(mapped, dtype=np.int64, count=3 * world)
        self.arrive, self.done, self.pids = (
            words[:world],
            words[world : 2 * world],
            words[2 * world :],
        )
        data = torch.frombuffer(mapped, dtype=torch.uint8, offset=header_bytes)
        self.slots = data.view(2, world, SLOT_BYTES)
        self.sequence = 0  # chunks exchanged so far, the same on every rank
        self.calls = 0  # buckets averaged
        self.seconds = 0.0  # spent averaging them (ddp.shared_memory_allreduce)

    # -- set-up ---------------------------------------------------------------------------
    @classmethod
    def open(cls, rank: int, world: int, timeout_s: float) -> SharedMemoryAllreduce | None:
        """Map the job's shared file on every rank of the current process group, or return
        None on every rank when one of them cannot (see the module). A collective."""
        folder, mapped, name = shm_folder(), None, ""
        if rank == 0 and folder is not None:  # created before anyone is told its name
            name = os.path.join(folder, f"spark-estimator-{os.getpid()}-{secrets.token_hex(8)}")
            mapped = _map(name, rank, world)
            name = name if mapped is not None else ""
        names = [name]
        dist.broadcast_object_list(names, src=0)
        if rank != 0 and names[0] and folder is not None:
            mapped = _map(names[0], rank, world)
        ok = torch.tensor([1 if mapped is not None else 0])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # everyone mapped it (and wrote its pid)
        seen = ok.item() == 1 and _peers_visible(mapped, world)
        ok = torch.tensor([1 if seen else 0])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # everyone sees every peer's process
        if rank == 0 and names[0]:
            try:
                os.unlink(names[0])
            except OSError:
                pass
        if ok.item() != 1:
            if mapped is not None:
                mapped.close()
            return None
        return cls(mapped, rank, world, timeout_s)

    def close(self) -> None:
        """Unmap; a peer still waiting for this rank then raises (``LEFT``)."""
        if self.pids is not None:
            self.pids[self.rank] = LEFT
        self.arrive = self.done = self.pids = self.slots = None
        try:
            self.mapped.close()
        except BufferError:  # a view is still referenced: the mapping goes with it
            pass

    # -- the collective -------------------------------------------------------------------
    def average_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Replace contiguous ``tensor`` with its mean over the ranks; returns it."""
        flat = tensor.view(-1).view(torch.uint8)
        size = tensor.element_size()
        step = SLOT_BYTES - SLOT_BYTES % size
        for start in range(0, flat.numel(), step):
            self._sum_chunk(flat[start : start + step], tensor.dtype)
        self.calls += 1
        return tensor.div_(self.world)

    def _sum_chunk(self, chunk: torch.Tensor, dtype: torch.dtype) -> None:
        self.sequence += 1
        sequence, nbytes = self.sequence, chunk.numel()
        parity = sequence % 2
        self._wait(self.done, sequence - 2)  # everyone has read this set's last chunk
        self.slots[parity, self.rank, :nbytes].copy_(chunk)
        self.arrive[self.rank] = sequence
        self._wait(self.arrive, sequence)
        slots = self.slots[parity, :, :nbytes].view(dtype)
        out = chunk.view(dtype)
        out.copy_(slots[0])
        for r in range(1, self.world):  # rank order: every rank gets the same bits
            out.add_(slots[r])
        self.done[self.rank] = sequence

    def _wait(self, flags: np.ndarray, value: int) -> None:
        if value <= 0 or (flags >= value).all():
            return
        start = time.monotonic()
        check_at, spins = start + LIVENESS_S, 0
        while not (flags >= value).all():
            spins += 1
            if spins < _SPIN:
                os.sched_yield()
            else:
                time.sleep(50e-6)
            now = time.monotonic()
            if now >= check_at:
                self._check_peers(flags, value, now - start)
                check_at = now + LIVENESS_S

    def _check_peers(self, flags: np.ndarray, value: int, waited: float) -> None:
        missing = [r for r in range(self.world) if flags[r] < value]
        left = [r for r in missing if self.pids[r] == LEFT]
        if left:
            raise RuntimeError(
                f"{SHM_TAG} rank {self.rank}: rank {left[0]} left the job (its training "
                "stopped) during a gradient allreduce"
            )
        dead = [r for r in missing if not _alive(int(self.pids[r]))]
        if dead:
            raise RuntimeError(
                f"{SHM_TAG} rank {self.rank}: the process of rank {dead[0]} "
                f"(pid {int(self.pids[dead[0]])}) ended during a gradient allreduce"
            )
        if waited > self.timeout_s:
            raise RuntimeError(
                f"{SHM_TAG} rank {self.rank}: rank(s) {missing} did not reach the gradient "
                f"allreduce within collective_timeout={self.timeout_s:g} s"
            )


def _header_bytes(world: int) -> int:
    return -(-8 * 3 * world // 4096) * 4096


def _map(path: str, rank: int, world: int) -> mmap.mmap | None:
    """Create (rank 0) or open the shared file and map it; write this rank's pid. None if
    this rank cannot (no such file here, no space)."""
    size = _header_bytes(world) + 2 * world * SLOT_BYTES
    try:
        if rank == 0:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS later
            except OSError:
                os.close(fd)
                os.unlink(path)
                raise
        else:
            fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                return None
            mapped = mmap.mmap(fd, size)
        finally:
            os.close(fd)
    except OSError:
        return None
    words = np.frombuffer(mapped, dtype=np.int64, count=3 * world)
    words[2 * world + rank] = os.getpid()
    del words
    return mapped


def _peers_visible(mapped: mmap.mmap, world: int) -> bool:
    words = np.frombuffer(mapped, dtype=np.int64, count=3 * world)
    return all(_alive(int(pid)) for pid in words[2 * world :])


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists here and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
