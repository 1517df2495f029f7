from spark_estimator.shared.serialization import state_from_bytes
from spark_estimator.worker.loop.checkpoints import Checkpoints


def test_every_epoch_is_kept_by_default(store):
    checkpoints = Checkpoints(store, "r", keep=None)
    for epoch in range(1, 4):
        checkpoints.write(epoch, {"history": [epoch]})
    assert checkpoints.epochs() == [1, 2, 3]
    assert checkpoints.last().endswith("epoch-0003.pt")
    saved = state_from_bytes(store.read_bytes(checkpoints.path(2)))
    assert saved == {"epoch": 2, "history": [2]}


def test_the_last_k_and_the_protected_epochs_are_kept(store):
    checkpoints = Checkpoints(store, "r", keep=2)
    for epoch in range(1, 7):
        checkpoints.write(epoch, {}, protected={2})
    assert checkpoints.epochs() == [2, 5, 6]


def test_no_checkpoint_yet(store):
    assert Checkpoints(store, "r", keep=1).last() is None
