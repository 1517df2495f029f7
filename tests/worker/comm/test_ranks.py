from spark_estimator.worker.comm.ranks import (
    cross_ranks,
    homogeneous,
    local_ranks,
    node_ranks,
    ranks_by_host,
)


def test_local_rank_counts_tasks_on_the_same_host():
    hosts = ["a", "b", "a", "a", "b"]
    assert [local_ranks(hosts, r) for r in range(5)] == [(0, 3), (0, 2), (1, 3), (2, 3), (1, 2)]


def test_a_job_is_homogeneous_when_every_host_runs_as_many_ranks():
    assert homogeneous(["a", "b", "a", "b"]) and homogeneous(["a"])
    assert not homogeneous(["a", "a", "b"])


def test_cross_rank_counts_tasks_with_the_same_local_rank():
    hosts = ["a", "b", "a", "a", "b"]  # local ranks 0, 0, 1, 2, 1
    assert [cross_ranks(hosts, r) for r in range(5)] == [(0, 2), (1, 2), (0, 2), (0, 1), (1, 2)]


def test_ranks_by_host_numbers_each_hosts_tasks_in_a_row_and_keeps_task_0_first():
    # Spark hands out a job's tasks round-robin over the executors: a, b, a, b, c, a
    hosts = ["a", "b", "a", "b", "c", "a"]
    order = ranks_by_host(hosts)
    assert order == [0, 2, 5, 1, 3, 4]  # the task of each rank: a's three, b's two, c's
    assert [hosts[task] for task in order] == ["a", "a", "a", "b", "b", "c"]
    assert ranks_by_host(["b", "a", "a"]) == [0, 1, 2]  # the hosts by their first task
    assert ranks_by_host([]) == []


def test_node_ranks_are_the_hosts_index_by_their_first_rank_and_their_count():
    hosts = ["a", "a", "b", "b", "c"]  # the host of each rank, numbered host by host
    assert [node_ranks(hosts, r) for r in range(5)] == [(0, 3), (0, 3), (1, 3), (1, 3), (2, 3)]


def test_with_ranks_by_host_local_and_cross_ranks_follow_the_new_numbering():
    spark_order = ["a", "b", "a", "b"]
    hosts = [spark_order[task] for task in ranks_by_host(spark_order)]
    assert [local_ranks(hosts, r) for r in range(4)] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    # one rank per local rank and host: a cross rank is its host's index
    assert [cross_ranks(hosts, r)[0] for r in range(4)] == [
        node_ranks(hosts, r)[0] for r in range(4)
    ]
