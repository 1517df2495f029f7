"""A batch's rows of bytes handed to a decode worker through shared memory."""

import os

import numpy as np
import pyarrow as pa

from spark_estimator.worker.data.binary_rows import BinaryRows
from spark_estimator.worker.decode import inbox as inbox_module
from spark_estimator.worker.decode.inbox import SMALLEST, Inbox, Inboxes, Posted
from spark_estimator.worker.decode.shared_memory import ShmFull


def test_posted_rows_are_read_back_as_the_arrays_of_objects_they_stand_for():
    images = BinaryRows.from_arrow(pa.array([b"\x00" * 10, b"", b"jpeg" * 300], pa.binary()))
    names = BinaryRows.from_arrow(pa.array(["a.jpg", "b.jpg", "ç.jpg"], pa.string()))
    label = np.array([1, 2, 3])
    rank, worker = Inboxes(), Inbox()
    values, sent_names, size, fds = rank.post((0, 1), {"image": images, "label": label}, names)
    assert isinstance(values["image"], Posted) and values["label"] is label
    assert size == SMALLEST and len(fds) == 1  # a new segment: its descriptor goes along
    got, got_names = worker.take(1, size, [os.dup(fds[0])], values, sent_names)
    assert list(got["image"]) == images.tolist() and list(got_names) == names.tolist()
    assert got["image"].dtype == object and got["label"] is label
    # the slot's next batch reuses its segment: nothing new to send
    again, _, size, fds = rank.post((0, 1), {"image": images[::-1], "label": label}, None)
    assert size is None and fds == ()
    got, _ = worker.take(1, None, [], again, None)
    assert list(got["image"]) == images.tolist()[::-1]
    rank.close()
    worker.close()


def test_a_batch_larger_than_its_segment_gets_a_new_one():
    rank = Inboxes()
    small = BinaryRows.from_arrow(pa.array([b"x"], pa.binary()))
    big = BinaryRows.from_arrow(pa.array([b"y" * (SMALLEST + 1)], pa.binary()))
    _, _, first, _ = rank.post((2, 0), {"b": small}, None)
    values, _, grown, fds = rank.post((2, 0), {"b": big}, None)
    assert first == SMALLEST and grown > SMALLEST and len(fds) == 1
    got, _ = Inbox().take(0, grown, [os.dup(fds[0])], values, None)
    assert got["b"][0] == b"y" * (SMALLEST + 1)
    rank.close()


def test_without_shared_memory_the_rows_travel_in_the_message(monkeypatch):
    def full(size, fd=None):
        raise ShmFull(28, "no room")

    monkeypatch.setattr(inbox_module, "Segment", full)
    rows = BinaryRows.from_arrow(pa.array([b"a", b"bc"], pa.binary()))
    values, _, size, fds = Inboxes().post((0, 0), {"b": rows}, None)
    assert values["b"] is rows and size is None and fds == ()


def test_plain_rows_send_nothing_through_shared_memory():
    values, names, size, fds = Inboxes().post((0, 0), {"x": np.array([b"a"], dtype=object)}, None)
    assert size is None and fds == () and isinstance(values["x"], np.ndarray)
