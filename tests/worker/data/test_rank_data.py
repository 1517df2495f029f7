import itertools
from collections import Counter

import pytest
import torch

from spark_estimator.worker.data.loader import open_loader
from spark_estimator.worker.data.rank_data import training_steps
from spark_estimator.worker.data.shards import StepPlan
from tests.conftest import write_id_dataset
from tests.worker.data.test_loader import train_spec


class CountingLoader:
    """Batches named (pass, index in pass)."""

    def batches(self, sizes, pass_index):
        return ((pass_index, i) for i in range(len(sizes)))


def test_training_steps_run_pass_after_pass_and_can_start_after_the_steps_done():
    plan = StepPlan(total_rows=10, world_size=1, rank=0, batch_size=4)  # 3 steps per pass
    steps = [
        batch for batch, _, _ in itertools.islice(training_steps(CountingLoader(), plan, 1, 3), 7)
    ]
    assert steps == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2), (3, 0)]
    resumed = training_steps(CountingLoader(), plan, 1, 3, start=4)  # 4 steps were done
    assert [b for b, _, _ in itertools.islice(resumed, 3)] == steps[4:7]


def test_accumulation_groups_follow_the_epochs_across_passes():
    plan = StepPlan(total_rows=10, world_size=1, rank=0, batch_size=2)  # 5 steps per pass
    steps = list(itertools.islice(training_steps(CountingLoader(), plan, 2, 4), 12))
    assert [b for b, _, _ in steps] == [(p, i) for p in (1, 2, 3) for i in range(5)][:12]
    assert [last for _, _, last in steps] == [False, True] * 6
    # every group holds 4 rows, every batch 2 of them: weight 2 * 1 / 4
    assert {w for _, w, _ in steps} == {0.5}
    resumed = training_steps(CountingLoader(), plan, 2, 4, start=8)  # 2 epochs were done
    assert list(itertools.islice(resumed, 4)) == steps[8:12]


@pytest.mark.parametrize("first_holds", [True, False])
@pytest.mark.parametrize("buffer", [None, 5])  # 5 rows: smaller than the shard
def test_an_exact_resume_trains_every_row_once_when_held_and_streamed_alternate(
    tmp_path, store, first_holds, buffer
):
    # one launch holds the shard on its device, the next (less memory free) streams it, or
    # the other way round: the resumed launch skips the batches already trained on, so
    # both must cut the pass in the same order
    data = write_id_dataset(tmp_path, [10, 1, 12], row_group_size=4)  # 23 rows
    spec = train_spec(data, store, seed=4, shuffle=True, shuffle_buffer_size=buffer)
    world, done = 2, 3
    for rank in range(world):
        plan = StepPlan(23, world, rank, 2)  # 6 steps a pass
        first = launch(spec, world, rank, plan, first_holds, 0, done)
        trained = first + launch(spec, world, rank, plan, not first_holds, done, plan.steps - done)
        counts = Counter(trained)
        repeated = sorted(i for i, n in counts.items() if n > 1)
        assert repeated == [] and len(counts) == plan.rows


def launch(spec, world, rank, plan, hold, start, count):
    """The row ids of ``count`` training batches after the first ``start`` of a launch
    that holds its shard (``hold``) or streams it."""
    device = torch.device("cpu") if hold else None
    loader = open_loader(spec, "train", world, rank, False, device)
    steps = training_steps(loader, plan, 1, plan.steps, start)
    return [i for batch, _, _ in itertools.islice(steps, count) for i in batch["y"].tolist()]
