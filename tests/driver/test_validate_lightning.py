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
