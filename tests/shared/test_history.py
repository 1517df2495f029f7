import pytest

from spark_estimator.shared.history import time_shares


def test_time_shares_are_of_the_training_seconds_of_all_ranks():
    seconds = {
        "train": [2.0, 6.0],
        "data": [1.0, 1.0],
        "compute": [1.0, 4.0],
        "communication": [0.0, 1.0],
    }
    assert time_shares({"epoch": 1, "seconds": seconds}) == {
        "data": pytest.approx(0.25),
        "compute": pytest.approx(0.625),
        "communication": pytest.approx(0.125),
    }
    assert time_shares({"epoch": 1}) is None  # a Lightning record
