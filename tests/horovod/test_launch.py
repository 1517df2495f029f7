"""hvd.run: Horovod's horovod.run signature, on Spark barrier tasks (local[4])."""

import pytest

import spark_estimator.horovod as hvd


def train(scale, offset=0.0):
    import torch

    import spark_estimator.horovod as hvd

    hvd.init()
    print(f"hello from {hvd.rank()}")
    total = hvd.allreduce(torch.tensor([hvd.rank() * scale]), op=hvd.Sum)
    return float(total) + offset


def test_horovods_run_call_returns_every_ranks_result_and_writes_their_output(spark, tmp_path):
    out = tmp_path / "out"
    with pytest.warns(UserWarning, match="hosts: Spark's scheduler places the tasks"):
        results = hvd.run(
            train,
            args=(2.0,),
            kwargs={"offset": 0.5},
            np=2,
            hosts="localhost:2",
            use_gloo=True,
            output_filename=str(out),
        )
    assert results == [2.5, 2.5]
    for rank in (0, 1):
        assert (out / f"rank.{rank}" / "stdout").read_text() == f"hello from {rank}\n"


@pytest.mark.parametrize(
    "keywords, message",
    [
        (dict(use_mpi=True), "use_mpi: MPI is not offered"),
        (dict(mpi_args="--bind-to none"), "mpi_args: MPI is not offered"),
        (dict(use_gloo=False), "use_gloo: MPI is not offered"),
    ],
)
def test_mpi_is_refused_before_any_job(keywords, message):
    with pytest.raises(ValueError, match=message):
        hvd.run(train, args=(1.0,), np=2, **keywords)


def test_np_is_the_size_a_run_starts_with_and_max_np_the_most(spark):
    # as horovodrun's -np / --max-np: a script that is not elastic never grows
    assert hvd.run(train, args=(1.0,), np=2, min_np=1, max_np=3) == [1.0, 1.0]


def test_max_np_below_np_is_refused_before_any_job():
    with pytest.raises(ValueError, match="max_np: 2 is less than np=3"):
        hvd.run(train, np=3, min_np=1, max_np=2)


def test_a_keyword_horovod_does_not_have_is_named():
    with pytest.raises(TypeError, match="num_workers: not a keyword of horovod.run"):
        hvd.run(train, np=2, num_workers=2)
