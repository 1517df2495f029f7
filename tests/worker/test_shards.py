import pytest

from spark_estimator.worker.shards import (
    StepPlan,
    eval_sizes,
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


def test_loss_weights_make_the_ddp_average_an_exact_mean():
    rows, world = 9, 2
    plans = [StepPlan(rows, world, r, 4) for r in range(world)]
    for step in range(plans[0].steps):
        sizes = [p.batch_sizes[step] for p in plans]
        weights = [p.weights()[step] for p in plans]
        # DDP averages over ranks: sum_r weight_r * mean_r / world is the rows-weighted mean
        for size, weight in zip(sizes, weights):
            assert weight * sum(sizes) / world == pytest.approx(size)
    empty = StepPlan(3, 4, 3, 1)  # rank 3 of 4 has no rows; its zero-loss steps weigh 1
    assert empty.batch_sizes == [0] and empty.weights() == [1.0]


def test_group_weights_make_an_accumulated_step_the_exact_mean_over_its_rows():
    rows, world, group = 23, 2, 3
    plans = [StepPlan(rows, world, r, 2) for r in range(world)]
    steps = plans[0].steps  # 12 rows on rank 0: 6 steps; rank 1 has 11 rows
    ends = plans[0].group_ends(group)
    assert ends == [False, False, True, False, False, True]
    for start in range(0, steps, group):
        group_rows = sum(p.batch_sizes[s] for p in plans for s in range(start, start + group))
        for p in plans:
            for s in range(start, start + group):
                # weight x mean loss / world, summed over the group, is rows / group_rows
                assert p.weights(group)[s] * group_rows / world == pytest.approx(p.batch_sizes[s])
    assert StepPlan(10, 1, 0, 2).group_ends(4) == [False, False, False, True, True]


def test_eval_sizes():
    assert eval_sizes(5, 2, None) == [2, 2, 1]
    assert eval_sizes(5, 2, 2) == [2, 2]
    assert eval_sizes(0, 2, None) == []
