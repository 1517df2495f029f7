import pytest
import torch

from spark_estimator.driver.run_manifest import (
    check_resume,
    check_resume_data,
    data_fields,
    run_manifest,
    write_manifest,
)
from spark_estimator.shared.spec import ColumnSpec, DatasetInfo


def dataset(rows=100):
    return DatasetInfo(
        path="/store/datasets/k",
        features=[ColumnSpec("x", "array", "float32")],
        labels=[ColumnSpec("y", "scalar", "float32")],
        files={"train": [("train/a.parquet", [rows])]},
        source={"key": "k"},
    )


def manifest(net=None, num_proc=2, rows=100):
    net = net or torch.nn.Linear(3, 1)
    data = dataset(rows)
    fields = {"num_proc": num_proc, "batch_size": 8, "input_shapes": ((3,),)}
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    return {**run_manifest(net, opt, fields), **data_fields(data)}


def checkpoint(store, run_id, *epochs):
    for epoch in epochs:
        store.write_bytes(store.run(run_id).checkpoint(epoch), b"x")


def test_a_run_without_checkpoints_starts_afresh(store):
    write_manifest(store, "r", manifest(num_proc=4))
    assert check_resume(store, "r", manifest(), epochs=3) == 0


def test_the_same_fit_resumes_after_the_newest_checkpoint(store):
    write_manifest(store, "r", manifest())
    checkpoint(store, "r", 1, 2)
    assert check_resume(store, "r", manifest(), epochs=5) == 2  # tuples read back as lists


@pytest.mark.parametrize(
    "changed,field",
    [
        (dict(net=torch.nn.Linear(3, 2)), "model"),
        (dict(num_proc=3), "num_proc"),
        (dict(rows=99), "data"),
    ],
)
def test_a_fit_that_changes_what_checkpoints_mean_is_refused(store, changed, field):
    write_manifest(store, "r", manifest())
    checkpoint(store, "r", 1)
    with pytest.raises(
        ValueError,
        match=f"run_id: run 'r' has checkpoints up to epoch 1 made with another {field} ",
    ):
        check_resume(store, "r", manifest(**changed), epochs=3)


def test_fewer_epochs_than_already_done_is_refused(store):
    write_manifest(store, "r", manifest())
    checkpoint(store, "r", 1, 2, 3)
    with pytest.raises(ValueError, match="up to epoch 3, past epochs=2"):
        check_resume(store, "r", manifest(), epochs=2)
    assert check_resume(store, "r", manifest(), epochs=3) == 3  # nothing left: the result


def test_the_data_is_checked_on_its_own_once_known(store):
    write_manifest(store, "r", manifest())
    check_resume_data(store, "r", dataset(rows=99))  # no checkpoints: nothing to resume
    checkpoint(store, "r", 1)
    check_resume_data(store, "r", dataset())
    with pytest.raises(
        ValueError, match="run_id: run 'r' has checkpoints up to epoch 1 made with another data "
    ):
        check_resume_data(store, "r", dataset(rows=99))
