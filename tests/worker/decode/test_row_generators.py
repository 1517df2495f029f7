"""The rows' augmentation generators made a batch at a time (``row_generators``)."""

import pickle

import numpy as np
import pytest

from spark_estimator.worker.decode import row_generators as rg


@pytest.mark.parametrize(
    "seed, epoch, rows",
    [
        (0, 0, [0, 1, 2]),
        (42, 7, list(range(1000, 1300))),
        (2**32 - 1, 2**32 - 1, [2**32 - 1, 0, 123456789]),
        (2**40, 1, [5, 6]),  # a seed of two words: made one by one by default_rng
    ],
)
def test_each_rows_generator_is_numpys_default_rng_of_seed_epoch_and_row(seed, epoch, rows):
    made = rg.row_generators(seed, epoch, np.array(rows))
    assert len(made) == len(rows)
    for generator, row in zip(made, rows):
        numpy = np.random.default_rng([seed, epoch, row])
        assert generator.bit_generator.state == numpy.bit_generator.state
        assert generator.integers(0, 2**62, 4).tolist() == numpy.integers(0, 2**62, 4).tolist()


def test_the_rows_generators_are_independent_and_where_numpy_disagrees_it_makes_them(monkeypatch):
    first, second = rg.row_generators(3, 1, [10, 11])
    before = second.bit_generator.state
    first.random(100)
    assert second.bit_generator.state == before  # drawing from one leaves the other
    assert rg.row_generators(3, 1, []) == []
    made = []
    monkeypatch.setattr(rg, "_agreed", False)  # a NumPy whose seeding changed
    monkeypatch.setattr(rg, "_seeded", lambda *a: made.append(a))
    again = rg.row_generators(3, 1, [10, 11])
    assert (
        not made
        and again[0].bit_generator.state == np.random.default_rng([3, 1, 10]).bit_generator.state
    )


def test_a_rows_generator_spawns_the_children_default_rng_spawns():
    seed, epoch, rows = 42, 7, [3, 2**32 - 1]
    for generator, row in zip(rg.row_generators(seed, epoch, rows), rows):
        numpy = np.random.default_rng([seed, epoch, row])
        for n in (2, 1):  # a second spawn continues where the first left off, as NumPy's
            ours, theirs = generator.spawn(n), numpy.spawn(n)
            assert [g.integers(0, 2**62, 3).tolist() for g in ours] == [
                g.integers(0, 2**62, 3).tolist() for g in theirs
            ]
        ours, theirs = generator.bit_generator.seed_seq, numpy.bit_generator.seed_seq
        assert ours.entropy == theirs.entropy and ours.spawn_key == theirs.spawn_key
        assert ours.n_children_spawned == theirs.n_children_spawned == 3
        assert ours.generate_state(3).tolist() == theirs.generate_state(3).tolist()
        copy = pickle.loads(pickle.dumps(generator))  # a decode_fn's result may carry it
        assert copy.spawn(1)[0].random() == numpy.spawn(1)[0].random()
        assert generator.random() == numpy.random()  # spawning leaves the parent's stream
