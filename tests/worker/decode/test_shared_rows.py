"""The loader's large binary rows read straight into shared memory, read there by workers."""

import gc
import os

import numpy as np
import pyarrow as pa
import torch

from spark_estimator.shared.spec import ColumnSpec
from spark_estimator.worker.data.binary_rows import BinaryRows
from spark_estimator.worker.data.columns import Layout
from spark_estimator.worker.decode import shared_rows
from spark_estimator.worker.decode.inbox import Inbox
from spark_estimator.worker.decode.shared_memory import ShmFull
from spark_estimator.worker.decode.shared_rows import FREE_KEPT, InShared, SharedRows

BIG = [bytes([i]) * (shared_rows.SHARE_FROM // 4 + i) for i in range(6)]
LAYOUT = Layout(
    {
        "y": torch.empty(0, dtype=torch.int64),
        "img": BinaryRows.empty(),
        "name": BinaryRows.empty(text=True),
    },
    [ColumnSpec("y", "scalar", "int64"), ColumnSpec("img", "binary", "float32")],
)


def chunk(blobs):
    return LAYOUT.assemble(
        {
            "y": np.arange(len(blobs)),
            "img": BinaryRows.from_arrow(pa.array(blobs, pa.binary())),
            "name": BinaryRows.from_arrow(pa.array([f"{i}.jpg" for i in range(len(blobs))])),
        }
    )


class Worker:
    """A worker's side: what the rank announced, mapped as a worker maps it."""

    def __init__(self):
        self.inbox, self.announced = Inbox(), []

    def announce(self, key, size, fd):
        self.announced.append(key)
        self.inbox.map_shared(key, size, os.dup(fd))


def test_a_chunk_s_large_rows_are_shared_and_a_worker_reads_a_batch_where_they_are():
    worker = Worker()
    shared = SharedRows(worker.announce)
    columns = shared.share(chunk(BIG))
    img, name = columns["img"], columns["name"]
    assert isinstance(img.parts[0], np.ndarray) and img.tolist() == BIG  # in a segment
    assert isinstance(name.parts[0], memoryview)  # small: left for the inbox to copy
    assert worker.announced == [0]
    batch = columns.take(np.array([4, 1, 4]))
    sent = shared.describe({"img": batch["img"], "name": batch["name"]})
    assert isinstance(sent["img"], InShared) and sent["name"] is batch["name"]
    got, _ = worker.inbox.take(0, None, [], {"img": sent["img"]}, None)
    assert list(got["img"]) == [BIG[4], BIG[1], BIG[4]]


def test_a_segment_no_row_refers_to_is_reused_and_beyond_the_free_ones_closed():
    worker = Worker()
    shared = SharedRows(worker.announce)
    columns = shared.share(chunk(BIG))
    del columns
    gc.collect()
    again = shared.share(chunk(BIG[::-1]))  # reuses the free segment: nothing announced
    assert worker.announced == [0] and again["img"].tolist() == BIG[::-1]
    many = [shared.share(chunk(BIG)) for _ in range(FREE_KEPT + 2)]
    del many, again
    gc.collect()
    gone, seen = shared.gone_since(0)
    assert len(shared.free) == FREE_KEPT and len(gone) == seen == 3
    worker.inbox.unmap_shared(gone)
    assert not set(gone) & set(worker.inbox.shared)
    shared.close()


def test_without_shared_memory_the_rows_stay_where_they_were_read(monkeypatch):
    def full(size, fd=None):
        raise ShmFull(28, "no room")

    monkeypatch.setattr(shared_rows, "Segment", full)
    columns = SharedRows(Worker().announce).share(chunk(BIG))
    assert isinstance(columns["img"].parts[0], memoryview)
    sent = SharedRows(Worker().announce).describe({"img": columns["img"]})
    assert sent["img"] is columns["img"]  # not described: the inbox copies these rows
