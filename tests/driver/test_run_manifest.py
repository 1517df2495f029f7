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


def dataset(rows=100, digest="00000000000000aa", key="k", feature="x"):
    return DatasetInfo(
        path=f"/store/datasets/{key}",
        features=[ColumnSpec(feature, "array", "float32")],
        labels=[ColumnSpec("y", "scalar", "float32")],
        files={"train": [("train/a.parquet", [rows])]},
        source={"key": key, "content": {"rows": rows, "digest": digest}},
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
        (dict(rows=99), "data: rows per split"),
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
        ValueError,
        match="run_id: run 'r' has checkpoints up to epoch 1 made with another data: rows per "
        r"split \(was \{'train': 100, 'validation': 0\}, now \{'train': 99, 'validation': 0\}\); "
        r"the rows' content \(digest 00000000000000aa of 100 rows, now",
    ):
        check_resume_data(store, "r", dataset(rows=99))


def test_other_rows_are_refused_naming_what_differs(store):
    write_manifest(store, "r", manifest())
    checkpoint(store, "r", 1)
    with pytest.raises(ValueError) as refused:
        check_resume_data(store, "r", dataset(digest="00000000000000bb", key="k2"))
    message = str(refused.value)
    assert (
        "made with another data: the rows' content (digest 00000000000000aa of 100 rows, now "
        "00000000000000bb of 100 rows: some values differ) (see " in message
    )
    assert "rows per split" not in message and "dataset (" not in message  # only what differs
    with pytest.raises(ValueError, match=r"another data: columns \(was \['x \(array float32\)'"):
        check_resume_data(store, "r", dataset(feature="z", key="k3"))
    # the same rows and columns in another dataset (other write options): the dataset is named
    with pytest.raises(ValueError, match=r"another data: dataset \(was k, now k4: other input"):
        check_resume_data(store, "r", dataset(key="k4"))


def test_a_run_json_from_before_the_content_digest_still_resumes_on_its_dataset(store):
    """A run.json written before the data entry held the columns and the rows' content
    compares what both hold: the dataset and its rows per split."""
    old = manifest()
    old["data"] = {"dataset": "k", "rows": {"train": 100, "validation": 0}}
    write_manifest(store, "r", old)
    checkpoint(store, "r", 1)
    check_resume_data(store, "r", dataset())
    with pytest.raises(ValueError, match="another data: dataset \\(was k, now k2"):
        check_resume_data(store, "r", dataset(key="k2"))
