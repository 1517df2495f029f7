"""A decode worker's shared memory slots (``SlotWriter``): a batch's stacked columns are
collated straight into its slot, the rest copied in."""

import numpy as np
import torch

from spark_estimator.worker.data.decode_batch import BatchResult, Decoded, stack_rows
from spark_estimator.worker.data.decode_channel import Segment
from spark_estimator.worker.data.decode_worker import SlotWriter


def images(rows: int, size: int = 8) -> list[torch.Tensor]:
    """``decode_image``'s kind of tensors: channels-last views of ``[H, W, 3]`` pixels."""
    pixels = torch.randint(0, 256, (rows, size, size, 3), dtype=torch.uint8)
    return [p.permute(2, 0, 1) for p in pixels]


def read(reply: dict, segment: Segment) -> dict[str, torch.Tensor]:
    """The reply's tensors as the rank reads them out of the slot."""
    out = {}
    for _, name, offset, dtype, shape, stride in reply["layout"]:
        dtype = getattr(torch, dtype.split(".")[-1])
        flat = segment.view(offset, dtype, (int(torch.Size(shape).numel()),))
        out[name] = flat.as_strided(shape, stride).clone()
    return out


def test_rows_stack_in_their_memory_order_channels_last_images_into_a_channels_last_batch():
    rows = images(3)
    crops = [r[:, 1:6, 2:7] for r in rows]
    for given in (rows, crops):
        batch = stack_rows(given)
        assert torch.equal(batch, torch.stack(given))
        assert batch.is_contiguous(memory_format=torch.channels_last)
    plain = [r.contiguous() for r in rows]
    assert stack_rows(plain).is_contiguous() and torch.equal(stack_rows(plain), torch.stack(plain))


def test_a_stacked_column_is_collated_into_the_slot_and_the_rest_copied_after_it():
    writer = SlotWriter()
    rows = images(4)
    labels = torch.arange(4)
    reply, fds = writer.write(0, BatchResult(Decoded({"x": torch.stack(rows), "y": labels}, {}, 4)))
    assert len(fds) == 1  # the first batch makes the slot
    segment = writer.slots[0]
    allocate = writer.begin(0)
    stacked = stack_rows(rows, allocate)
    assert stacked.is_contiguous(memory_format=torch.channels_last)
    assert stacked.data_ptr() == segment.view(0, torch.uint8, (1,)).data_ptr()  # in the slot
    reply, fds = writer.write(0, BatchResult(Decoded({"x": stacked, "y": labels}, {}, 4)))
    assert not fds and writer.slots[0] is segment  # no new slot, nothing moved
    offsets = {name: offset for _, name, offset, *_ in reply["layout"]}
    assert offsets["x"] == 0 and offsets["y"] >= 4 * 3 * 8 * 8
    got = read(reply, segment)
    assert torch.equal(got["x"], torch.stack(rows)) and torch.equal(got["y"], labels)


def test_a_batch_that_outgrows_its_slot_moves_whole_into_a_larger_one():
    writer = SlotWriter()
    writer.write(1, BatchResult(Decoded({"x": torch.stack(images(2))}, {}, 2)))
    small = writer.slots[1]
    rows = images(2)
    allocate = writer.begin(1)
    stacked = stack_rows(rows, allocate)  # fits the old slot
    assert stacked.data_ptr() == small.view(0, torch.uint8, (1,)).data_ptr()
    more = torch.from_numpy(np.arange(1000, dtype=np.int64))  # ... which this does not
    reply, fds = writer.write(1, BatchResult(Decoded({"x": stacked, "n": more}, {}, 2)))
    grown = writer.slots[1]
    assert len(fds) == 1 and grown is not small and grown.size >= 2 * 3 * 64 + 8000
    got = read(reply, grown)
    assert torch.equal(got["x"], torch.stack(rows)) and torch.equal(got["n"], more)
    del stacked  # the batch's tensors gone: the old slot is closed at the next batch
    writer.begin(0)
    assert small.fd == -1 and not writer.retired
