import dataclasses
import json

from spark_estimator.shared.summary import RankSummary, seconds_per_rank, training_summary


def test_a_rank_summary_goes_through_json_and_back_unchanged():
    summary = RankSummary(
        rank=1,
        local_rank=0,
        pid=42,
        host="h",
        device="cpu",
        device_note=None,
        gradient_path="gloo compressed",
        communicated_dtypes=["float16"],
        gradient_allreduces=6,
        train_rows=40,
        validation_rows=10,
        validation_batches_per_epoch=1,
        data_placement="held on cpu: 0.1 MiB within 100.0 MiB (0.5 x 200 MiB of available RAM)",
        batches_per_epoch=[2, 2, 2],
        optimizer_steps_per_epoch=[1, 1, 1],
        weights_digest="abc",
        seconds=1.5,
    )
    assert RankSummary(**json.loads(json.dumps(dataclasses.asdict(summary)))) == summary


def test_the_training_summary_says_how_the_run_went():
    history = [{"epoch": 1}, {"epoch": 2}]
    selection = {"epoch": 1, "monitor": "validation.loss"}
    assert training_summary(2, 5, history, 1, 2, selection, [1, 2]) == {
        "world_size": 2,
        "epochs_run": 2,
        "resumed_from_epoch": 1,
        "stopped_early": True,
        "early_stopping_epoch": 2,
        "selected_epoch": 1,
        "selection": selection,
        "checkpoints": [1, 2],
    }
    done = training_summary(1, 2, history, 0, None, None, [2])
    assert done["resumed_from_epoch"] is None and not done["stopped_early"]
    assert done["selected_epoch"] == 2


def test_seconds_per_rank_add_up_the_epochs_of_each_rank():
    epoch = {
        "train": [2.0, 3.0],
        "data": [0.5, 1.0],
        "compute": [1.0, 1.5],
        "communication": [0.5, 0.5],
    }
    history = [{"epoch": 1, "seconds": epoch}, {"epoch": 2, "seconds": epoch}, {"epoch": 3}]
    assert seconds_per_rank(history) == {k: [2 * a, 2 * b] for k, (a, b) in epoch.items()}
    assert seconds_per_rank([{"epoch": 1}]) is None
