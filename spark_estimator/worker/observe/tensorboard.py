"""Executor: TensorBoard event files of a run's per-epoch history, written by rank 0.

After every epoch rank 0 rewrites the run's one event file,
``runs/<run_id>/tensorboard/events.out.tfevents.spark-estimator``, from the whole history
(so a resumed run's file holds every epoch once): one scalar per split and value
(``train/loss``, ``validation/loss``, ``train/<metric>``...) and one per param group's
learning rate (``lr/group_<i>``), at step = epoch. Point TensorBoard at the
folder (``tensorboard --logdir <store>/runs``; for an s3:// store TensorBoard needs its own
S3 support, or copy the folder).

The file is written here, not with ``torch.utils.tensorboard``, so the package needs no
TensorBoard install: it is TensorBoard's record format (length, masked CRC-32C, payload,
masked CRC-32C) holding ``Event`` protocol buffers, encoded by hand below.
"""

from __future__ import annotations

import posixpath
import struct
import time

from ...shared.history import epoch_scalars
from ...store import Store


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


class TensorBoardLog:
    """Rank 0's event file for one training task."""

    def __init__(self, store: Store, run_id: str):
        self.store = store
        name = "events.out.tfevents.spark-estimator"  # TensorBoard reads any "*tfevents*"
        self.path = posixpath.join(store.run(run_id).tensorboard, name)
        self.header = _record(_event(time.time(), 0, _bytes_field(3, b"brain.Event:2")))
        self.encoded: dict[int, bytes] = {}  # epoch -> its record, encoded once

    def write(self, history: list[dict]) -> None:
        """Rewrite the file with every epoch of ``history``."""
        for record in history:
            if record["epoch"] not in self.encoded:
                event = _event(time.time(), record["epoch"], _scalars(epoch_scalars(record)))
                self.encoded[record["epoch"]] = _record(event)
        epochs = [record["epoch"] for record in history]
        self.store.write_bytes(self.path, self.header + b"".join(self.encoded[e] for e in epochs))
