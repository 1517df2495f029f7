"""A decoded batch in a worker's shared memory slot (``SlotWriter``, ``SlotBatch``): its
stacked columns collated straight into the slot, the rest copied in, and every tensor read
back by the rank as the worker laid it out (dtype, shape, strides), as views of the slot or
as copies."""

import numpy as np
import pytest
import torch

from spark_estimator.worker.decode import batch_format
from spark_estimator.worker.decode.batch_format import Placed, SlotWriter
from spark_estimator.worker.decode.collate import stack_rows
from spark_estimator.worker.decode.decoded import BatchResult, Decoded
from spark_estimator.worker.decode.delivery import Delivery
from spark_estimator.worker.decode.shared_memory import ShmFull
from tests.worker.decode.test_collate import images


def read(batch, segment, how="copy") -> BatchResult:
    """The batch as the rank takes it out of ``segment`` (``Delivery``)."""
    released = []
    result = Delivery(how).take(batch, segment, lambda: released.append(1), view=True)
    return result


def test_a_batch_round_trips_through_a_slot_as_views_and_as_copies():
    rows = images(3)
    columns = {
        "img": stack_rows(rows),  # channels-last
        "x": torch.randn(3, 5),
        "half": torch.randn(3, 4).to(torch.bfloat16),  # a dtype NumPy lacks
        "t": torch.arange(12).view(4, 3).t(),  # neither contiguous nor channels-last
        "none": torch.empty(0, 7),
        "text": ["a", "b", "c"],  # not a tensor: in the message
    }
    masks = {"x": torch.tensor([[True, False]] * 3)}
    kept = np.array([0, 2, 3])
    result = BatchResult(Decoded(columns, masks, 3), kept, [(False, 1)], [4, 6])
    writer = SlotWriter()
    writer.begin(0)
    batch, fds = writer.write(0, result)
    assert len(fds) == 1 and batch.segment_size == writer.slots[0].size
    assert all(isinstance(p, Placed) and p.offset % batch_format.ALIGN == 0 for p in batch.placed)
    assert batch.inline == {("columns", "text"): ["a", "b", "c"]}
    for how in ("view", "copy"):
        got = read(batch, writer.slots[0], how)
        assert got.kept.tolist() == [0, 2, 3] and got.skipped == [(False, 1)]
        assert got.padding == [4, 6] and got.decoded.rows == 3
        assert list(got.decoded.columns) == list(columns)  # in their order
        for name, value in columns.items():
            back = got.decoded.columns[name]
            if not isinstance(value, torch.Tensor):
                assert back == value
                continue
            assert back.dtype == value.dtype and torch.equal(back, value), (how, name)
        assert got.decoded.columns["img"].is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(got.decoded.masks["x"], masks["x"])
        seen = got.decoded.columns["x"].data_ptr()
        inside = writer.slots[0].address() <= seen < writer.slots[0].address() + batch.span
        assert inside == (how == "view")


def test_a_stacked_column_is_collated_into_the_slot_and_the_rest_copied_after_it():
    writer = SlotWriter()
    rows = images(4)
    labels = torch.arange(4)
    batch, fds = writer.write(0, BatchResult(Decoded({"x": torch.stack(rows), "y": labels}, {}, 4)))
    assert len(fds) == 1  # the first batch makes the slot
    segment = writer.slots[0]
    stacked = stack_rows(rows, writer.begin(0))
    assert stacked.is_contiguous(memory_format=torch.channels_last)
    assert stacked.data_ptr() == segment.address()  # in the slot
    batch, fds = writer.write(0, BatchResult(Decoded({"x": stacked, "y": labels}, {}, 4)))
    assert not fds and writer.slots[0] is segment  # no new slot, nothing moved
    offsets = {p.name: p.offset for p in batch.placed}
    assert offsets["x"] == 0 and offsets["y"] >= 4 * 3 * 8 * 8
    got = read(batch, segment).decoded
    assert torch.equal(got["x"], torch.stack(rows)) and torch.equal(got["y"], labels)


def test_a_batch_that_outgrows_its_slot_moves_whole_into_a_larger_one():
    writer = SlotWriter()
    writer.write(1, BatchResult(Decoded({"x": torch.stack(images(2))}, {}, 2)))
    small = writer.slots[1]
    rows = images(2)
    stacked = stack_rows(rows, writer.begin(1))  # fits the old slot
    assert stacked.data_ptr() == small.address()
    more = torch.from_numpy(np.arange(1000, dtype=np.int64))  # ... which this does not
    batch, fds = writer.write(1, BatchResult(Decoded({"x": stacked, "n": more}, {}, 2)))
    grown = writer.slots[1]
    assert len(fds) == 1 and grown is not small and grown.size >= 2 * 3 * 64 + 8000
    got = read(batch, grown).decoded
    assert torch.equal(got["x"], torch.stack(rows)) and torch.equal(got["n"], more)
    assert small.fd == -1  # given up; its memory stays while ``stacked`` views it
    assert torch.equal(stacked, torch.stack(rows))


def test_where_no_shared_memory_can_be_had_the_tensors_travel_in_the_message(monkeypatch):
    def full(size, fd=None):
        raise ShmFull(28, "no room")

    monkeypatch.setattr(batch_format, "Segment", full)
    x = torch.randn(2, 3)
    batch, fds = SlotWriter().write(0, BatchResult(Decoded({"x": x}, {}, 2)))
    assert not fds and not batch.placed and batch.inline_reason == "no room"
    got = Delivery("view").take(batch, None, lambda: None, view=True).decoded
    assert torch.equal(got["x"], x)


@pytest.mark.parametrize("rows", [0, 2])
def test_a_batch_without_tensors_or_rows_needs_no_slot(rows):
    result = BatchResult(Decoded({"text": ["a"] * rows}, {}, rows))
    batch, fds = SlotWriter().write(0, result)
    assert not fds and not batch.placed
    got = Delivery("view").take(batch, None, lambda: None, view=True).decoded
    assert got["text"] == ["a"] * rows
