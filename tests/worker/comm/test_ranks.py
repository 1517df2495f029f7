from spark_estimator.worker.comm.ranks import cross_ranks, homogeneous, local_ranks


def test_local_rank_counts_tasks_on_the_same_host():
    hosts = ["a", "b", "a", "a", "b"]
    assert [local_ranks(hosts, r) for r in range(5)] == [(0, 3), (0, 2), (1, 3), (2, 3), (1, 2)]


def test_a_job_is_homogeneous_when_every_host_runs_as_many_ranks():
    assert homogeneous(["a", "b", "a", "b"]) and homogeneous(["a"])
    assert not homogeneous(["a", "a", "b"])


def test_cross_rank_counts_tasks_with_the_same_local_rank():
    hosts = ["a", "b", "a", "a", "b"]  # local ranks 0, 0, 1, 2, 1
    assert [cross_ranks(hosts, r) for r in range(5)] == [(0, 2), (1, 2), (0, 2), (0, 1), (1, 2)]
