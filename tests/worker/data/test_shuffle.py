"""The order of a shuffled pass: refills fixed by the buffer's size, not by batch sizes."""

import torch

from spark_estimator.worker.data.shuffle import default_buffer_rows, pass_order, windows


def test_each_refill_fills_the_buffer_with_whole_chunks_and_keeps_half_of_it():
    gen = torch.Generator().manual_seed(0)
    got = [(w.chunks, len(w.perm), w.serve) for w in windows([4] * 10, 10, gen)]
    # 3 chunks (12 rows), 5 kept; 5 + 2 chunks = 13, 5 kept; ...; the last serves all
    assert got == [(3, 12, 7), (2, 13, 8), (2, 13, 8), (2, 13, 8), (1, 9, 9)]
    assert sum(serve for _, _, serve in got) == 40


def test_a_pass_serves_every_row_once_and_mixes_across_chunks():
    order = pass_order([4] * 10, 10, torch.Generator().manual_seed(1))
    assert sorted(order.tolist()) == list(range(40))
    assert order.tolist() != list(range(40))
    again = pass_order([4] * 10, 10, torch.Generator().manual_seed(1))
    assert torch.equal(order, again)


def test_a_buffer_as_large_as_the_pass_is_one_permutation_of_it():
    order = pass_order([3, 5, 2], 10, torch.Generator().manual_seed(2))
    assert torch.equal(order, torch.randperm(10, generator=torch.Generator().manual_seed(2)))


def test_the_default_buffer_holds_256_mib_of_rows():
    assert default_buffer_rows(64) == 2**22 and default_buffer_rows(2**30) == 1
