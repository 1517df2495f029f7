import cloudpickle
import pytest
import torch

from spark_estimator.shared.spec import ColumnSpec, DatasetInfo, LoopSpec, TrainSpec
from spark_estimator.worker.comm.ranks import RankInfo
from spark_estimator.worker.loop.objects import build_losses, build_objects


def rank_info(world: int) -> RankInfo:
    """Rank 0 of ``world`` on the CPU (no process group: ``build_objects`` needs one only
    to shard)."""
    return RankInfo(0, world, 0, world, torch.device("cpu"))


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
    objects = build_objects(made, rank_info(4))
    assert objects.base_lrs == [0.1, 0.5]
    assert [g["lr"] for g in objects.optimizer.param_groups] == [0.4, 2.0]
    assert objects.scheduler.base_lrs == [0.4, 2.0]
    unscaled = build_objects(spec(store), rank_info(4))
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
    objects = build_objects(weighted, rank_info(1))
    assert objects.loss.losses[0].reduction == "none"


def test_loss_constructors_run_here(store):
    made = spec(store, labels=("a", "b"), loss=None, loss_constructors=[torch.nn.L1Loss])
    objects = build_objects(made, rank_info(1))
    assert [type(f).__name__ for f in objects.loss.losses] == ["L1Loss", "L1Loss"]


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.ones(4))

    def reset_parameters(self):
        torch.nn.init.ones_(self.scale)

    def forward(self, x):
        return self.linear(x) * self.scale


def test_an_optimizer_is_built_anew_on_the_shards_with_its_groups_by_name(store, process_group):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 4), Block())
    groups = [
        {"params": [net[0].weight, net[1].scale], "lr": 0.5},
        {"params": [net[0].bias, net[1].linear.weight, net[1].linear.bias]},
    ]
    made = spec(
        store,
        loop=LoopSpec(parallelism="fsdp", fsdp_wrap=("Block",)),
        model=net,
        optimizer=torch.optim.Adam(groups, lr=0.1, betas=(0.8, 0.9)),
    )
    objects = build_objects(made, rank_info(1))
    names = {id(p): n for n, p in objects.model.named_parameters()}
    built = objects.optimizer
    assert isinstance(built, torch.optim.Adam) and built.defaults["betas"] == (0.8, 0.9)
    assert [[names[id(p)] for p in g["params"]] for g in built.param_groups] == [
        ["0.weight", "1.scale"],
        ["0.bias", "1.linear.weight", "1.linear.bias"],
    ]
    assert [g["lr"] for g in built.param_groups] == [0.5, 0.1]
    assert all(type(p).__name__ == "DTensor" for g in built.param_groups for p in g["params"])


def test_a_model_function_on_meta_is_materialized_and_an_optimizer_function_called_on_it(
    store, process_group
):
    def make():
        with torch.device("meta"):
            return torch.nn.Sequential(torch.nn.Linear(2, 4), Block())

    for parallelism in ("ddp", "fsdp"):
        made = spec(
            store,
            loop=LoopSpec(parallelism=parallelism),
            model=make,
            optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.3),
        )
        model = build_objects(made, rank_info(1)).model
        weights = {
            k: v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in model.state_dict().items()
        }
        assert not any(v.is_meta for v in weights.values())
        assert torch.equal(weights["1.scale"], torch.ones(4))  # Block.reset_parameters
        assert weights["0.weight"].abs().max() <= 0.5**0.5  # Linear's own init: 1/sqrt(2)
        assert weights["0.weight"].std() > 0


def test_an_optimizer_function_that_returns_no_optimizer_is_named(store):
    made = spec(store, optimizer=lambda model: [model])
    with pytest.raises(
        TypeError, match="optimizer: the function must return a torch.optim.Optimizer, got list"
    ):
        build_objects(made, rank_info(1))
