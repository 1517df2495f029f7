import itertools

from spark_estimator.worker.data.rank_data import training_steps
from spark_estimator.worker.data.shards import StepPlan


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
