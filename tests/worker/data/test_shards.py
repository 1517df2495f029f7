import itertools

import pytest
import torch

from spark_estimator.worker.data.shards import (
    Piece,
    StepPlan,
    eval_sizes,
    even_pieces,
    piece_order,
    shard_bounds,
    shard_pieces,
    split_sizes,
)


@pytest.mark.parametrize("rows,world", [(10, 3), (9, 2), (1, 4), (0, 2), (1000, 8)])
def test_shards_partition_rows_evenly(rows, world):
    bounds = [shard_bounds(rows, world, r) for r in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == rows
    assert all(bounds[r][1] == bounds[r + 1][0] for r in range(world - 1))
    sizes = [e - s for s, e in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_split_sizes():
    assert split_sizes(5, 2) == [3, 2] and split_sizes(2, 3) == [1, 1, 0]


def test_pieces_cover_exactly_the_ranks_rows_across_files_and_row_groups():
    files = [("a", [4, 4, 2]), ("b", [1]), ("c", [4, 4, 4])]  # 23 rows
    seen = []
    for rank in range(3):
        pieces = shard_pieces(files, 3, rank)
        start, end = shard_bounds(23, 3, rank)
        assert sum(p.rows for p in pieces) == end - start
        offsets = {"a": 0, "b": 10, "c": 11}
        for p in pieces:
            group_start = offsets[p.path] + 4 * p.row_group
            assert 0 <= p.start < p.stop <= p.group_rows
            seen += range(group_start + p.start, group_start + p.stop)
    assert seen == list(range(23))
    assert shard_pieces(files, 30, 29) == []  # more ranks than rows: an empty shard


@pytest.mark.parametrize("rows,world,batch", [(9, 2, 4), (10, 3, 2), (101, 4, 8), (3, 4, 1)])
def test_every_rank_takes_the_same_steps_and_every_row_is_in_one_batch(rows, world, batch):
    plans = [StepPlan(rows, world, r, batch) for r in range(world)]
    assert len({p.steps for p in plans}) == 1
    for rank, plan in enumerate(plans):
        start, end = shard_bounds(rows, world, rank)
        assert sum(plan.batch_sizes) == end - start == plan.rows
        assert len(plan.batch_sizes) == plan.steps and max(plan.batch_sizes) <= batch


def schedule(plan, group, epoch_steps, batches, start=0):
    return list(itertools.islice(plan.schedule(group, epoch_steps, start), batches))


def test_loss_weights_make_the_ddp_average_an_exact_mean():
    rows, world = 9, 2
    plans = [StepPlan(rows, world, r, 4) for r in range(world)]
    steps = plans[0].steps
    for step in range(steps):
        sizes = [p.batch_sizes[step] for p in plans]
        weights = [schedule(p, 1, steps, steps)[step][0] for p in plans]
        # DDP averages over ranks: sum_r weight_r * mean_r / world is the rows-weighted mean
        for size, weight in zip(sizes, weights):
            assert weight * sum(sizes) / world == pytest.approx(size)
    empty = StepPlan(3, 4, 3, 1)  # rank 3 of 4 has no rows; its zero-loss steps weigh 1
    assert empty.batch_sizes == [0] and schedule(empty, 1, 1, 1) == [(1.0, True)]


def assert_exact_group_means(plans, group, epoch_steps, batches):
    """Every group's weights x rows / world sum to the group's rows over all ranks, each
    batch weighing its share (``weight x group rows / world == its rows``)."""
    world, steps = len(plans), plans[0].steps
    ends = [last for _, last in schedule(plans[0], group, epoch_steps, batches)]
    first = 0
    for b, last in enumerate(ends):
        if not last:
            continue
        members = range(first, b + 1)
        group_rows = sum(p.batch_sizes[m % steps] for p in plans for m in members)
        for p in plans:
            weights = schedule(p, group, epoch_steps, batches)
            for m in members:
                size = p.batch_sizes[m % steps]
                assert weights[m][0] * group_rows / world == pytest.approx(size)
        first = b + 1
    return ends


def test_group_weights_make_an_accumulated_step_the_exact_mean_over_its_rows():
    rows, world, group = 23, 2, 3
    plans = [StepPlan(rows, world, r, 2) for r in range(world)]
    steps = plans[0].steps  # 12 rows on rank 0: 6 steps; rank 1 has 11 rows
    ends = assert_exact_group_means(plans, group, steps, 2 * steps)
    assert ends == [False, False, True] * 4
    short_last = schedule(StepPlan(10, 1, 0, 2), 4, 5, 10)  # an epoch = a pass of 5
    assert [last for _, last in short_last] == [False, False, False, True, True] * 2


@pytest.mark.parametrize(
    "epoch_steps,group,ends",
    [
        (3, 2, [False, True, True]),  # an epoch of 3 batches: groups of 2 and 1
        (4, 2, [False, True, False, True]),  # passes of 5: groups span their boundaries
        (7, 3, [False, False, True, False, False, True, True]),
    ],
)
def test_groups_cut_each_epoch_of_train_steps_per_epoch_batches(epoch_steps, group, ends):
    plans = [StepPlan(19, 2, r, 2) for r in range(2)]  # 10 and 9 rows: 5 steps per pass
    assert plans[0].steps == 5 and plans[1].batch_sizes == [2, 2, 2, 2, 1]
    epochs = 5
    got = assert_exact_group_means(plans, group, epoch_steps, epochs * epoch_steps)
    assert got == ends * epochs
    full = schedule(plans[1], group, epoch_steps, epochs * epoch_steps)
    for start in (epoch_steps, 2 * epoch_steps, 3):  # a resume, and a start inside an epoch
        resumed = schedule(plans[1], group, epoch_steps, len(full) - start, start)
        assert resumed == full[start:]


def test_eval_sizes():
    assert eval_sizes(5, 2, None) == [2, 2, 1]
    assert eval_sizes(5, 2, 2) == [2, 2]
    assert eval_sizes(0, 2, None) == []


def rows_of(pieces, layout):
    """Each piece's rows as (path, row in its file), in order."""
    firsts = {}
    for path, groups in layout:
        at = 0
        for g, rows in enumerate(groups):
            firsts[path, g] = at
            at += rows
    return [
        (p.path, firsts[p.path, p.row_group] + r) for p in pieces for r in range(p.start, p.stop)
    ]


def test_even_pieces_join_tiny_row_groups_of_a_file_and_cut_huge_ones():
    layout = [("a", [10] * 7), ("b", [100]), ("c", [10, 10])]
    size = {("a", g): 10 for g in range(7)} | {("b", 0): 100} | {("c", 0): 10, ("c", 1): 10}
    pieces = shard_pieces(layout, 2, 1)  # rows 95..189: b's last 75 rows, c
    even = even_pieces(pieces, size, target=30)
    assert rows_of(even, layout) == rows_of(pieces, layout)  # the same rows, in order
    spans = [(p.path, p.row_group, p.groups, p.start, p.stop) for p in even]
    assert spans == [
        ("b", 0, 1, 25, 50),  # b (100 bytes, over 2 x 30): its 75 rows here in 3 parts
        ("b", 0, 1, 50, 75),
        ("b", 0, 1, 75, 100),
        ("c", 0, 2, 0, 20),  # c's two small groups: one piece
    ]
    first = shard_pieces(layout, 2, 0)  # rows 0..94: a's 7 groups and 25 of b's
    spans = [(p.path, p.row_group, p.groups, p.rows) for p in even_pieces(first, size, 30)]
    # a's groups joined up to 30 bytes; a quarter of b (25 bytes) is left whole
    assert spans == [("a", 0, 3, 30), ("a", 3, 3, 30), ("a", 6, 1, 10), ("b", 0, 1, 25)]


def test_piece_order_permutes_row_groups_keeping_their_parts_together_in_order():
    parts = [Piece("b", 0, lo, lo + 25, 100) for lo in range(0, 100, 25)]
    pieces = [Piece("a", 0, 0, 10, 10), *parts, Piece("c", 0, 0, 20, 20, groups=2)]
    orders = {tuple(piece_order(pieces, torch.Generator().manual_seed(seed))) for seed in range(20)}
    assert len(orders) > 1  # permuted
    for order in orders:
        at = order.index(1)
        assert list(order[at : at + 4]) == [1, 2, 3, 4] and sorted(order) == list(range(6))
    assert piece_order(pieces, None) == list(range(6))
    plain = [Piece(p, 0, 0, 5, 5) for p in "abcdef"]  # one piece per row group: randperm's
    generator = torch.Generator().manual_seed(3)
    expected = torch.randperm(6, generator=torch.Generator().manual_seed(3)).tolist()
    assert piece_order(plain, generator) == expected
