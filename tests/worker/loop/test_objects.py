import cloudpickle
import torch

from spark_estimator.shared.spec import ColumnSpec, DatasetInfo, LoopSpec, TrainSpec
from spark_estimator.worker.loop.objects import build_losses, build_objects


def spec(store, labels=("y",), loop=None, **objects):
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1)
    bundle = {
        "model": net,
        "optimizer": torch.optim.SGD(
            [{"params": [net.weight]}, {"params": [net.bias], "lr": 0.5}], lr=0.1
        ),
        "loss": torch.nn.MSELoss(),
        **objects,
    }
    data = DatasetInfo(
        path=store.root,
        features=[ColumnSpec("x", "array", "float32")],
        labels=[ColumnSpec(n, "scalar", "float32") for n in labels],
        files={},
    )
    return TrainSpec(
        cloudpickle.dumps(bundle), data, store, "r", 8, 1, 0, False, None, loop=loop or LoopSpec()
    )


def test_linear_scaling_multiplies_every_group_before_the_scheduler_is_built(store):
    made = spec(
        store,
        loop=LoopSpec(lr_scaling="linear"),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1),
    )
    objects = build_objects(made, world_size=4, device=torch.device("cpu"))
    assert objects.base_lrs == [0.1, 0.5]
    assert [g["lr"] for g in objects.optimizer.param_groups] == [0.4, 2.0]
    assert objects.scheduler.base_lrs == [0.4, 2.0]
    unscaled = build_objects(spec(store), world_size=4, device=torch.device("cpu"))
    assert [g["lr"] for g in unscaled.optimizer.param_groups] == [0.1, 0.5]


def test_losses_one_for_all_labels_or_one_each():
    mse, l1 = torch.nn.MSELoss(), torch.nn.L1Loss()
    assert build_losses(mse, None, 3) == [mse] * 3
    assert build_losses([mse, l1], None, 2) == [mse, l1]
    built = build_losses(None, [torch.nn.L1Loss], 2)
    assert len(built) == 2 and all(isinstance(b, torch.nn.L1Loss) for b in built)


def test_sample_weights_switch_loss_modules_to_per_row(store):
    weighted = spec(store)
    weighted.data.sample_weight = ColumnSpec("w", "scalar", "float32")
    objects = build_objects(weighted, world_size=1, device=torch.device("cpu"))
    assert objects.loss.losses[0].reduction == "none"


def test_loss_constructors_run_here(store):
    made = spec(store, labels=("a", "b"), loss=None, loss_constructors=[torch.nn.L1Loss])
    objects = build_objects(made, world_size=1, device=torch.device("cpu"))
    assert [type(f).__name__ for f in objects.loss.losses] == ["L1Loss", "L1Loss"]
