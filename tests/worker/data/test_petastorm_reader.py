"""The petastorm reader: equal to the Arrow reader on the legacy stack, a clear error elsewhere."""

import numpy as np
import pytest

from spark_estimator.shared.packages import require_petastorm
from spark_estimator.worker.data.arrow_reader import ArrowReader
from spark_estimator.worker.data.petastorm_reader import PetastormReader
from spark_estimator.worker.data.shards import StepPlan, shard_pieces
from tests.conftest import write_id_dataset

try:
    require_petastorm()
    HAS_PETASTORM = True
except ImportError:
    HAS_PETASTORM = False

needs_petastorm = pytest.mark.skipif(
    not HAS_PETASTORM, reason="petastorm imports only on the legacy stack"
)
pytestmark = pytest.mark.legacy


@pytest.mark.skipif(HAS_PETASTORM, reason="petastorm imports on this stack")
def test_without_a_working_petastorm_the_error_names_the_stack_that_works():
    import pyarrow

    with pytest.raises(ImportError) as info:
        require_petastorm()
    message = str(info.value)
    assert message.startswith("reader: 'petastorm' cannot be used here")
    assert f"pyarrow {pyarrow.__version__}" in message
    assert "pyarrow 14.0.2" in message and "reader='arrow'" in message


@needs_petastorm
def test_petastorm_reads_the_same_pieces_as_arrow(tmp_path, store):
    data = write_id_dataset(tmp_path, [10, 1, 12], row_group_size=4)
    files = data.files["train"]
    arrow = ArrowReader(store, data.path, data.columns, num_workers=2)
    peta = PetastormReader(store, data.path, data.columns, num_workers=2, files=files)
    for rank in range(3):
        pieces = shard_pieces(files, 3, rank)
        expected = list(arrow.chunks(pieces))
        got = list(peta.chunks(pieces))
        assert len(got) == len(expected)
        for a, b in zip(expected, got):
            assert a.keys() == b.keys()
            assert all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


@needs_petastorm
def test_petastorm_loader_gives_exact_seeded_epochs(tmp_path, store):
    from tests.worker.data.test_loader import epoch_ids, train_spec

    data = write_id_dataset(tmp_path, [10, 1, 12], row_group_size=4)
    spec = train_spec(data, store, reader="petastorm", shuffle_buffer_size=6, seed=3)
    first = epoch_ids(spec, 3, 3, 1)
    assert sorted(i for rank in first for b in rank for i in b) == list(range(23))
    assert len({len(rank) for rank in first}) == 1
    assert epoch_ids(spec, 3, 3, 1) == first and epoch_ids(spec, 3, 3, 2) != first
    ordered = train_spec(data, store, reader="petastorm", shuffle=False)
    assert epoch_ids(ordered, 3, 3, 1) == epoch_ids(train_spec(data, store, shuffle=False), 3, 3, 1)
    assert StepPlan(23, 3, 0, 3).steps == len(first[0])


@needs_petastorm
def test_petastorm_refuses_a_shuffled_piece_order(tmp_path, store):
    data = write_id_dataset(tmp_path, [8], row_group_size=4)
    files = data.files["train"]
    peta = PetastormReader(store, data.path, data.columns, num_workers=1, files=files)
    with pytest.raises(ValueError, match="reader: petastorm reads row groups in file order"):
        list(peta.chunks(shard_pieces(files, 1, 0)[::-1]))


def test_in_background_keeps_order_forwards_errors_and_stops_early():
    from spark_estimator.worker.data.petastorm_reader import in_background

    assert list(in_background(iter(range(50)), 3)) == list(range(50))

    def failing():
        yield 1
        raise OSError("disk gone")

    stream = in_background(failing(), 2)
    assert next(stream) == 1
    with pytest.raises(OSError, match="disk gone"):
        next(stream)

    closed = []

    def endless():
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed.append(True)

    stream = in_background(endless(), 2)
    assert next(stream) == 0
    stream.close()
    assert closed == [True]
