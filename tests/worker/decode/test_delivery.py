"""How a rank takes a batch out of its worker's slot: views keep the slot until no tensor
views it any more; copies give it back at once."""

import functools
import gc

import torch

from spark_estimator.worker.decode.batch_format import SlotWriter
from spark_estimator.worker.decode.decoded import BatchResult, Decoded
from spark_estimator.worker.decode.delivery import Delivery


def written():
    writer = SlotWriter()
    x = torch.arange(24, dtype=torch.float32).view(4, 6)
    batch, _ = writer.write(0, BatchResult(Decoded({"x": x, "y": x[:, 0].clone()}, {}, 4)))
    return writer.slots[0], batch, x


def test_views_give_the_slot_back_once_no_tensor_views_it():
    segment, batch, x = written()
    released = []
    decoded = Delivery("view").take(batch, segment, lambda: released.append(1), True).decoded
    rows = decoded["x"][1:3]  # a view of a view
    y = decoded["y"]
    del decoded
    gc.collect()
    assert not released
    del y
    gc.collect()
    assert not released
    assert torch.equal(rows, x[1:3])
    del rows
    gc.collect()
    assert released == [1]


def test_copies_give_the_slot_back_at_once_and_a_view_refused_is_a_copy():
    segment, batch, x = written()
    for mode, view in (("copy", True), ("view", False)):
        released: list[int] = []
        release = functools.partial(released.append, 1)
        decoded = Delivery(mode).take(batch, segment, release, view).decoded
        assert len(released) == 1
        segment.view(0, torch.uint8, (batch.span,)).zero_()  # the worker writes the next batch
        assert torch.equal(decoded["x"], x)
        segment, batch, x = written()
