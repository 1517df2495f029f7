"""A batch's rows collated: stacked in their memory order (channels-last images into a
channels-last batch), into the memory an ``allocate`` gives."""

import torch

from spark_estimator.worker.decode.collate import pad_sequences, stack_rows


def images(rows: int, size: int = 8) -> list[torch.Tensor]:
    """``decode_image``'s kind of tensors: channels-last views of ``[H, W, 3]`` pixels."""
    pixels = torch.randint(0, 256, (rows, size, size, 3), dtype=torch.uint8)
    return [p.permute(2, 0, 1) for p in pixels]


def test_rows_stack_in_their_memory_order_channels_last_images_into_a_channels_last_batch():
    rows = images(3)
    crops = [r[:, 1:6, 2:7] for r in rows]
    for given in (rows, crops):
        batch = stack_rows(given)
        assert torch.equal(batch, torch.stack(given))
        assert batch.is_contiguous(memory_format=torch.channels_last)
    plain = [r.contiguous() for r in rows]
    assert stack_rows(plain).is_contiguous() and torch.equal(stack_rows(plain), torch.stack(plain))


def test_rows_stack_into_the_memory_allocate_gives_or_their_own_where_it_gives_none():
    rows = images(2)
    room = torch.empty(2 * 8 * 8 * 3, dtype=torch.uint8)
    given = []

    def allocate(shape, dtype):
        given.append((shape, dtype))
        return room.view(shape)

    batch = stack_rows(rows, allocate)
    assert given == [((2, 8, 8, 3), torch.uint8)]  # the [B, H, W, C] pixels
    assert batch.data_ptr() == room.data_ptr() and torch.equal(batch, torch.stack(rows))
    batch = stack_rows(rows, lambda shape, dtype: None)
    assert batch.data_ptr() != room.data_ptr() and torch.equal(batch, torch.stack(rows))


def test_sequences_are_padded_to_the_longest_with_their_mask():
    padded, mask = pad_sequences([torch.tensor([1, 2, 3]), torch.tensor([4])], -1)
    assert padded.tolist() == [[1, 2, 3], [4, -1, -1]]
    assert mask.tolist() == [[True, True, True], [True, False, False]]
