import pytest
import torch

from spark_estimator.callbacks import BestModel, EarlyStopping, TrainingState, monitored_value


def state():
    net = torch.nn.Linear(1, 1)
    return TrainingState(0, 1, net, torch.optim.SGD(net.parameters(), lr=0.1))


def logs(value, split="validation"):
    return {split: {"loss": value}}


def test_early_stopping_waits_patience_epochs_without_improvement():
    cb, s = EarlyStopping(patience=2, min_delta=0.1), state()
    for epoch, value in enumerate([1.0, 0.5, 0.45, 0.3, 0.35, 0.31], start=1):
        cb.on_epoch_end(epoch, logs(value), s)
        if s.stop_training:
            break
    # 0.45 is not better than 0.5 by more than 0.1; 0.3 is; then 0.35 and 0.31 are not
    assert (epoch, cb.stopped_epoch, cb.best_epoch) == (6, 6, 4)


def test_max_mode_and_nan_never_improves():
    cb, s = EarlyStopping(monitor="train.loss", mode="max", patience=1), state()
    cb.on_epoch_end(1, logs(1.0, "train"), s)
    cb.on_epoch_end(2, logs(float("nan"), "train"), s)
    assert s.stop_training and cb.best_value == 1.0


def test_best_model_keeps_a_copy_of_the_best_weights():
    cb, s = BestModel(), state()
    cb.on_epoch_end(1, logs(2.0), s)
    best = {k: v.clone() for k, v in s.model.state_dict().items()}
    with torch.no_grad():
        s.model.weight.add_(1.0)
    cb.on_epoch_end(2, logs(3.0), s)
    assert cb.selection() == {"epoch": 1, "monitor": "validation.loss", "mode": "min", "value": 2.0}
    assert all(torch.equal(cb.best_state[k], v) for k, v in best.items())


def test_bad_monitor_and_mode_are_rejected_when_built():
    with pytest.raises(ValueError, match="callbacks: monitor must look like"):
        EarlyStopping(monitor="val_loss")
    with pytest.raises(ValueError, match="callbacks: mode must be"):
        BestModel(mode="lowest")
    with pytest.raises(KeyError, match="callbacks: monitor 'train.mae' is not in"):
        monitored_value(logs(1.0), "train.mae")
