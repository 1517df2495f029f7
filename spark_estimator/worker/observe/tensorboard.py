"""Executor: rank 0's TensorBoard event file of a run: the per-epoch history and, with
``log_every_steps``, the training loss every that many steps.

Rank 0 keeps the run's one event file,
``runs/<run_id>/tensorboard/events.out.tfevents.spark-estimator``, and rewrites it whole
(the store may be S3, which cannot append) after every epoch, and during an epoch at most
every ``STEP_FLUSH_S`` when it has new step scalars:

- per epoch, from the whole history (so a resumed run's file holds every epoch once), one
  scalar per split and value (``train/loss``, ``validation/loss``, ``train/<metric>``...),
  one per param group's learning rate (``lr/group_<i>``) and the slowest rank's seconds
  (``seconds/<kind>``), at step = epoch;
- every ``log_every_steps`` training batches (TorchEstimator only), on a step axis that
  counts the run's training batches: ``step/train_loss`` (rank 0's mean loss over the
  batches since the previous point of the same epoch) and ``step/lr_group_<i>``; and at each
  epoch's end ``step/epoch`` (the epoch's number, at the step it ended on). A resumed launch
  reads the file back, keeps the step scalars up to where it goes on from (those of a failed
  attempt past its checkpoint are dropped) and continues the axis from there (``start``).

Point TensorBoard at the folder (``tensorboard --logdir <store>/runs``; for an s3:// store
TensorBoard needs its own S3 support, or copy the folder).

The file is written here, not with ``torch.utils.tensorboard`` or tensorboardX, so the
executors need no TensorBoard install and it goes through the store like every other file:
it is TensorBoard's record format (length, masked CRC-32C, payload, masked CRC-32C) holding
``Event`` protocol buffers, encoded by hand below. The observability guide has the
measurements behind that choice; the CRC-32C is the same table-driven loop TensorBoard's own
writer runs without TensorFlow (about 35 microseconds for an epoch's event).
"""

from __future__ import annotations

import logging
import posixpath
import struct
import time

import torch

from ...shared.history import epoch_scalars
from ...store import Store

STEP_FLUSH_S = 10.0  # the most seconds new step scalars wait in memory during an epoch
STEP_PREFIX = "step/"  # the tags on the step axis
log = logging.getLogger(__name__)


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _record(payload: bytes) -> bytes:
    length = struct.pack("<Q", len(payload))
    return (
        length
        + struct.pack("<I", _masked_crc(length))
        + payload
        + struct.pack("<I", _masked_crc(payload))
    )


# -- protocol buffer encoding of the few Event fields used ---------------------------------
def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits, value = value & 0x7F, value >> 7
        out.append(bits | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _bytes_field(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _event(wall_time: float, step: int, body: bytes) -> bytes:
    # Event: wall_time = 1 (double), step = 2 (int64), then file_version = 3 or summary = 5
    head = _varint(1 << 3 | 1) + struct.pack("<d", wall_time)
    return head + _varint(2 << 3) + _varint(step) + body


def _scalars(values: dict[str, float]) -> bytes:
    # Summary { repeated Value value = 1 }, Value { tag = 1 (string), simple_value = 2 (float) }
    summary = b"".join(
        _bytes_field(1, _bytes_field(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", v))
        for tag, v in values.items()
    )
    return _bytes_field(5, summary)


# -- reading back the events written above (a resumed launch's) ------------------------------
def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at


def _fields(data: bytes):
    """(field number, value) of a message in the encoding above: bytes of a length-delimited
    field, the int of a varint, the raw bytes of a fixed one."""
    at = 0
    while at < len(data):
        key, at = _read_varint(data, at)
        kind = key & 7
        if kind == 0:
            value, at = _read_varint(data, at)
        elif kind == 2:
            size, at = _read_varint(data, at)
            value, at = data[at : at + size], at + size
        elif kind in (1, 5):
            size = 8 if kind == 1 else 4
            value, at = data[at : at + size], at + size
        else:
            raise ValueError(f"wire type {kind}")
        yield key >> 3, value


def _events(data: bytes) -> list[tuple[int, dict[str, float], bytes]]:
    """The (step, scalars by tag, record) of every summary event of a file written here."""
    events, at = [], 0
    while at < len(data):
        (size,) = struct.unpack_from("<Q", data, at)
        end = at + 12 + size + 4
        if end > len(data):
            raise ValueError("a truncated record")
        payload, record, at = data[at + 12 : end - 4], data[at:end], end
        step, values = 0, {}
        for number, value in _fields(payload):
            if number == 2:
                step = value
            elif number == 5:
                for _, item in _fields(value):
                    parts = dict(_fields(item))
                    values[parts[1].decode()] = struct.unpack("<f", parts[2])[0]
        if values:
            events.append((step, values, record))
    return events


class TensorBoardLog:
    """Rank 0's event file for one training task; ``every_steps``: the training batches
    between two points of the step scalars (0 or None: none)."""

    def __init__(self, store: Store, run_id: str, every_steps: int | None = None):
        self.store = store
        name = "events.out.tfevents.spark-estimator"  # TensorBoard reads any "*tfevents*"
        self.path = posixpath.join(store.run(run_id).tensorboard, name)
        self.header = _record(_event(time.time(), 0, _bytes_field(3, b"brain.Event:2")))
        self.encoded: dict[int, bytes] = {}  # epoch -> its record, encoded once
        self.epochs: list[int] = []  # the epochs the file holds, in order
        self.every = every_steps or 0
        self.steps: list[bytes] = []  # the step axis' records, in step order
        self.ended: dict[int, int] = {}  # epoch -> the step it ended on (step/epoch)
        self.offset = 0  # step = batches drawn + offset (start)
        self.pending: list[tuple] = []  # (step, (loss x rows, rows), lrs, CUDA event)
        self.flushed = time.monotonic()

    # -- the step axis --------------------------------------------------------------------
    def start(self, history: list[dict], into_epoch: int, drawn: int) -> None:
        """A launch's place on the step axis: it goes on after the epochs of ``history``
        (restored) and ``into_epoch`` batches of the next (a commit's), with ``drawn``
        batches drawn (the loop's count, restored). Keeps the file's step scalars up to
        there; the axis goes on from the step ``step/epoch`` gave the last epoch done, or
        else from ``drawn`` (an elastic fit that changed its number of processes counts
        ``drawn`` anew)."""
        self._encode_epochs(history)
        done = history[-1]["epoch"] if history else 0
        kept, at = self._earlier_steps(), drawn
        if not done:
            at = into_epoch
        else:
            ended = [s for s, v, _ in kept if v.get(STEP_PREFIX + "epoch") == done]
            if ended:
                at = ended[-1] + into_epoch
        self.steps = [record for step, _, record in kept if step <= at]
        self.ended = {
            int(v[STEP_PREFIX + "epoch"]): step
            for step, v, _ in kept
            if step <= at and STEP_PREFIX + "epoch" in v
        }
        self.offset = at - drawn

    def _earlier_steps(self) -> list[tuple[int, dict[str, float], bytes]]:
        """The step scalars of the file an earlier launch of the run left (none: a new run)."""
        if not self.store.exists(self.path):
            return []
        try:
            events = _events(self.store.read_bytes(self.path))
        except (ValueError, KeyError, IndexError, struct.error) as error:
            log.warning("TensorBoard: %s cannot be read back (%s): written anew", self.path, error)
            return []
        return [e for e in events if all(tag.startswith(STEP_PREFIX) for tag in e[1])]

    def due(self, drawn: int) -> bool:
        """Whether the batch that made ``drawn`` batches drawn is a point of the step axis."""
        return bool(self.every) and (drawn + self.offset) % self.every == 0

    def add_step(self, drawn: int, window: torch.Tensor, lrs: list[float]) -> None:
        """The point at ``drawn`` batches drawn: ``window`` holds (loss x rows, rows) of the
        training batches since the previous point (on a GPU it is read once it is there, no
        waiting); the learning rates by param group. Writes the file every STEP_FLUSH_S."""
        step, event = drawn + self.offset, None
        if window.device.type == "cuda":
            host = torch.empty(2, dtype=torch.float64, pin_memory=True)
            host.copy_(window, non_blocking=True)
            window, event = host, torch.cuda.Event()
            event.record()
        self.pending.append((step, window, list(lrs), event))
        self._encode_ready(wait=False)
        if time.monotonic() - self.flushed >= STEP_FLUSH_S:
            self._flush()

    def _encode_ready(self, wait: bool) -> None:
        while self.pending:
            step, window, lrs, event = self.pending[0]
            if event is not None and not wait and not event.query():
                return
            if event is not None:
                event.synchronize()
            self.pending.pop(0)
            loss_rows, rows = window.tolist()
            values = {STEP_PREFIX + "train_loss": loss_rows / rows} if rows else {}
            values.update({f"{STEP_PREFIX}lr_group_{i}": lr for i, lr in enumerate(lrs)})
            self.steps.append(_record(_event(time.time(), step, _scalars(values))))

    # -- the file -------------------------------------------------------------------------
    def write(self, history: list[dict], drawn: int | None = None) -> None:
        """Rewrite the file with every epoch of ``history``; with ``drawn`` (the batches
        drawn at the end of its last epoch) and the step axis on, mark that epoch's end."""
        self._encode_epochs(history)
        self._encode_ready(wait=True)
        epoch = history[-1]["epoch"] if history else 0
        if self.every and drawn is not None and history and epoch not in self.ended:
            self.ended[epoch] = step = drawn + self.offset
            marker = _scalars({STEP_PREFIX + "epoch": float(epoch)})
            self.steps.append(_record(_event(time.time(), step, marker)))
        self._flush()

    def flush(self) -> None:
        """Write the file with every step point so far (at a commit: a launch that goes on
        from it keeps them)."""
        self._encode_ready(wait=True)
        self._flush()

    def _encode_epochs(self, history: list[dict]) -> None:
        for record in history:
            if record["epoch"] not in self.encoded:
                event = _event(time.time(), record["epoch"], _scalars(epoch_scalars(record)))
                self.encoded[record["epoch"]] = _record(event)
        self.epochs = [record["epoch"] for record in history]

    def _flush(self) -> None:
        epochs = b"".join(self.encoded[e] for e in self.epochs)
        self.store.write_bytes(self.path, self.header + epochs + b"".join(self.steps))
        self.flushed = time.monotonic()
