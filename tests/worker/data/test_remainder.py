"""The rest of a resized epoch: the rows not yet trained on, re-sharded, read again from
the loaders of the epoch's first sharding (real Parquet)."""

import itertools
from collections import Counter

import pytest
import torch

from spark_estimator.worker.data.loader import open_loader
from spark_estimator.worker.data.remainder import Run, after, own_runs, remainder_batches, reshard
from spark_estimator.worker.data.shards import StepPlan
from tests.conftest import write_id_dataset
from tests.worker.data.test_loader import train_spec


def test_reshard_cuts_what_remains_into_near_equal_contiguous_parts():
    runs = own_runs(23, 3)  # shards of 8, 8, 7 rows
    left = [after(r, n) for r, n in zip(runs, [3, 3, 3])]
    assert left == [[Run(3, 0, 3, 8)], [Run(3, 1, 3, 8)], [Run(3, 2, 3, 7)]]
    parts = reshard(left, 2)
    assert [sum(run.rows for run in p) for p in parts] == [7, 7]
    assert parts == [[Run(3, 0, 3, 8), Run(3, 1, 3, 5)], [Run(3, 1, 5, 8), Run(3, 2, 3, 7)]]
    again = reshard([after(p, 2) for p in parts], 3)  # a second resize in the same epoch
    assert [sum(run.rows for run in p) for p in again] == [4, 3, 3]


@pytest.mark.parametrize("hold", [False, True])
@pytest.mark.parametrize("old, new, steps_done", [(3, 2, 1), (2, 3, 2), (3, 1, 0), (2, 2, 1)])
def test_every_row_of_the_epoch_once_across_a_resize(tmp_path, store, hold, old, new, steps_done):
    resized_epoch(tmp_path, store, hold, old, new, steps_done, buffer=None)


@pytest.mark.parametrize("hold", [False, True])
@pytest.mark.parametrize("buffer", [1, 2, 5])
@pytest.mark.parametrize("old, new, steps_done", [(3, 2, 1), (2, 3, 2), (1, 2, 1), (2, 2, 1)])
def test_every_row_once_across_a_resize_with_a_buffer_smaller_than_the_shard(
    tmp_path, store, hold, buffer, old, new, steps_done
):
    # the usual reason a shard is streamed: the re-read order must be the order trained on,
    # whatever batch sizes the re-read asks for
    resized_epoch(tmp_path, store, hold, old, new, steps_done, buffer)


def resized_epoch(tmp_path, store, hold, old, new, steps_done, buffer):
    """The first launch (``old`` ranks) trains ``steps_done`` batches of a pass, the next
    (``new`` ranks) the rest, re-sharded: every row of the epoch once."""
    data = write_id_dataset(tmp_path, [10, 1, 12], row_group_size=4)  # 23 rows
    spec = train_spec(data, store, shuffle=True, shuffle_buffer_size=buffer)
    batch, pass_index = 3, 2
    device = torch.device("cpu") if hold else None

    def loader(world, rank):
        return open_loader(spec, "train", world, rank, pin=False, hold_on=device)

    trained, consumed = [], []
    for rank in range(old):  # the first launch trains steps_done batches, then is lost
        plan = StepPlan(23, old, rank, batch)
        done = plan.batch_sizes[:steps_done]
        for b in itertools.islice(
            loader(old, rank).batches(plan.batch_sizes, pass_index), len(done)
        ):
            trained += b["y"].tolist()
        consumed.append(sum(done))
    parts = reshard([after(r, n) for r, n in zip(own_runs(23, old), consumed)], new)
    rows = [sum(run.rows for run in p) for p in parts]
    opened = {}

    def source(world, rank):
        return opened.setdefault((world, rank), loader(world, rank))

    template = {c.name: torch.empty(0, dtype=c.torch_dtype) for c in spec.data.columns}
    for rank in range(new):
        plan = StepPlan.over(rows, rank, batch)
        for b in remainder_batches(parts[rank], plan.batch_sizes, pass_index, source, template):
            trained += b["y"].tolist()
    counts = Counter(trained)
    repeated = sorted(i for i, n in counts.items() if n > 1)
    skipped = sorted(set(range(23)) - set(counts))
    assert (repeated, skipped) == ([], [])
