import pytest

from spark_estimator.driver import validate_lightning
from tests.test_lightning import DigitsModule, EarlyStopping, ModelCheckpoint, pl


class SharedStep(DigitsModule):
    """Validation delegates to its parent's validation_step, which logs val_loss and val_acc."""

    def validation_step(self, batch, batch_idx):
        return super().validation_step(batch, batch_idx)


@pytest.mark.parametrize("module", [DigitsModule(), SharedStep()])
def test_a_monitor_of_a_validation_value_without_validation_is_refused(module):
    callbacks = [EarlyStopping(monitor="train_acc"), ModelCheckpoint(monitor="val_acc")]
    refused = r"callbacks: ModelCheckpoint monitors 'val_acc', which .* logs in its validation"
    with pytest.raises(ValueError, match=refused + r".*set validation="):
        validate_lightning.check_monitors(module, callbacks, has_validation=False)
    validate_lightning.check_monitors(module, callbacks, has_validation=True)
    # values logged in training, and callbacks that monitor nothing, need no validation
    unmonitored = [EarlyStopping(monitor="train_acc"), ModelCheckpoint(), pl.Callback()]
    validate_lightning.check_monitors(module, unmonitored, has_validation=False)
    validate_lightning.check_monitors(module, None, has_validation=False)


def test_a_module_whose_source_cannot_be_read_is_checked_too():
    """A module defined in __main__ or a notebook is pickled by value; unpickling it in the
    same process (each fit does, on the driver) gives its class methods whose code has no
    readable source (cloudpickle's ``<dynamic-code>``): the check must not depend on it."""
    namespace = {}
    exec(
        "class Unread(Base):\n"
        "    def validation_step(self, batch, batch_idx):\n"
        "        self.log('val_f1', 1.0)\n",
        {"Base": DigitsModule},
        namespace,
    )
    module = namespace["Unread"]()
    with pytest.raises(ValueError, match="callbacks: EarlyStopping monitors 'val_f1'"):
        validate_lightning.check_monitors(
            module, [EarlyStopping(monitor="val_f1")], has_validation=False
        )
