import threading

import pytest
import torch

from spark_estimator.callbacks import BestModel, Callback, EarlyStopping
from spark_estimator.driver import validate_training as vt
from spark_estimator.shared.serialization import loads
from spark_estimator.shared.spec import LoopSpec

Y = ["y"]


def bundle(net=None, label_cols=Y, interval="epoch", **objects):
    net = net or torch.nn.Linear(2, 1)
    values = dict(
        model=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss=torch.nn.MSELoss(),
        loss_constructors=None,
        metrics=None,
        lr_scheduler=None,
        callbacks=None,
        train_minibatch_fn=None,
    )
    values.update(objects)
    return vt.training_bundle(values, label_cols, interval)[0]


def test_the_bundle_keeps_the_optimizer_on_the_models_parameters():
    objects = loads(bundle(metrics=[torch.nn.functional.l1_loss]))
    params = {id(p) for p in objects["model"].parameters()}
    assert {id(p) for g in objects["optimizer"].param_groups for p in g["params"]} == params
    assert list(objects["metrics"]) == ["l1_loss"]


def test_model_optimizer_and_loss_types():
    net = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module or a function"):
        bundle(model=3)
    with pytest.raises(TypeError, match="optimizer: model is a function"):
        bundle(model=lambda: torch.nn.Linear(2, 1))
    with pytest.raises(TypeError, match="optimizer: expected a torch.optim.Optimizer or a"):
        bundle(net, optimizer="adam")
    with pytest.raises(TypeError, match="loss: expected"):
        bundle(loss=3)
    bundle(loss=lambda out, y: ((out - y) ** 2).mean())


def test_optimizer_must_hold_the_models_parameters():
    other = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="optimizer: its parameters are not the model's"):
        bundle(optimizer=torch.optim.SGD(other.parameters(), lr=1))


def test_unpicklable_objects_are_named():
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)
            self.lock = threading.Lock()

    net = Holder()
    with pytest.raises(TypeError, match="model: cannot be serialized"):
        bundle(net, optimizer=torch.optim.SGD(net.parameters(), lr=1))
    lock = threading.Lock()

    def locked(out, y):
        with lock:
            return (out - y).abs().mean()

    with pytest.raises(TypeError, match="loss: cannot be serialized"):
        bundle(loss=locked)
    with pytest.raises(TypeError, match="metrics: cannot be serialized"):
        bundle(metrics={"m": locked})


def test_exactly_one_of_loss_and_loss_constructors_one_or_one_per_label():
    with pytest.raises(ValueError, match=r"loss: set exactly one .* \(neither"):
        bundle(loss=None)
    with pytest.raises(ValueError, match=r"loss: set exactly one .* \(both"):
        bundle(loss_constructors=[torch.nn.MSELoss])
    with pytest.raises(TypeError, match="loss_constructors: expected a list"):
        bundle(loss=None, loss_constructors=torch.nn.MSELoss)
    with pytest.raises(ValueError, match="loss: 2 given for 3 label columns"):
        bundle(loss=[torch.nn.MSELoss()] * 2, label_cols=["a", "b", "c"])
    bundle(loss=None, loss_constructors=[torch.nn.MSELoss, torch.nn.L1Loss], label_cols=["a", "b"])


def test_a_loss_that_is_no_function_is_refused_listing_what_loss_takes():
    with pytest.raises(TypeError) as refused:
        vt.check_losses(5, None, ["y"])
    assert str(refused.value).startswith(
        "loss: expected a loss module, a function (output, label) -> scalar tensor, or one of "
        "the names 'mse' / 'l2' (MSELoss), 'mae' / 'l1' (L1Loss), 'cross_entropy'"
    )
    assert str(refused.value).endswith(", got 5")


def test_metrics_need_distinct_usable_names():
    assert vt.check_metrics(None) is None
    with pytest.raises(ValueError, match="metrics: functions in a list"):
        vt.check_metrics([lambda o, y: o])
    with pytest.raises(ValueError, match="metrics: 'loss' is not a usable name"):
        vt.check_metrics({"loss": abs})
    with pytest.raises(TypeError, match="metrics: 'm' is not a function"):
        vt.check_metrics({"m": 3})


def test_loss_weights_one_per_label_non_negative():
    vt.check_loss_weights(None, Y)
    vt.check_loss_weights([0.0, 2.0], ["a", "b"])
    with pytest.raises(ValueError, match="loss_weights: 1 weights for 2 label columns"):
        vt.check_loss_weights([1.0], ["a", "b"])
    with pytest.raises(ValueError, match="loss_weights: must be >= 0"):
        vt.check_loss_weights([-1.0, 1.0], ["a", "b"])


def test_callbacks_are_callbacks_monitoring_metrics_the_fit_produces():
    vt.check_callbacks([Callback(), EarlyStopping("train.loss")], {"train.loss"})
    with pytest.raises(TypeError, match="callbacks: .* is not a spark_estimator"):
        vt.check_callbacks([object()], {"train.loss"})
    with pytest.raises(ValueError, match="callbacks: BestModel monitors 'validation.loss'"):
        vt.check_callbacks([BestModel()], {"train.loss"})


def test_loop_options():
    vt.check_loop(LoopSpec(), Y, None)
    for name, bad in (
        ("lr_scaling", "sqrt"),
        ("gradient_compression", "int8"),
        ("gradient_reduction", "sum"),
        ("mixed_precision", "fp8"),
        ("lr_scheduler_interval", "batch"),
    ):
        with pytest.raises(ValueError, match=f"{name}: must be one of"):
            vt.check_loop(LoopSpec(**{name: bad}), Y, None)
    with pytest.raises(ValueError, match="backward_passes_per_step: must be >= 1"):
        vt.check_loop(LoopSpec(backward_passes_per_step=0), Y, None)
    adasum = dict(gradient_reduction="adasum")
    vt.check_loop(LoopSpec(**adasum, gradient_compression="bf16"), Y, None)
    with pytest.raises(ValueError, match="lr_scaling: must be 'none' with gradient_reduction="):
        vt.check_loop(LoopSpec(**adasum, lr_scaling="linear"), Y, None)
    with pytest.raises(ValueError, match="loss_weights: 2 weights for 1 label columns"):
        vt.check_loop(LoopSpec(loss_weights=(1.0, 1.0)), Y, None)
    with pytest.raises(ValueError, match="train_minibatch_fn: your step owns backward"):
        vt.check_loop(LoopSpec(mixed_precision="bf16"), Y, abs)


def test_lr_scheduler_is_tried_without_touching_the_optimizer():
    net = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    bundle(net, optimizer=opt, lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1))
    assert "initial_lr" not in opt.param_groups[0]
    with pytest.raises(ValueError, match="lr_scheduler: calling it with the optimizer failed"):
        bundle(lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o))
    with pytest.raises(TypeError, match="lr_scheduler: must return a torch LR scheduler"):
        bundle(lr_scheduler=lambda o: 0.1)


def test_reduce_lr_on_plateau_is_refused_per_step():
    def plateau(o):
        return torch.optim.lr_scheduler.ReduceLROnPlateau(o)

    bundle(lr_scheduler=plateau)  # per epoch: stepped with the epoch's loss
    bundle(lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1), interval="step")
    with pytest.raises(ValueError, match="lr_scheduler_interval: 'step' cannot drive Reduce"):
        bundle(lr_scheduler=plateau, interval="step")


def test_compile_is_false_true_or_keyword_arguments_of_torch_compile():
    assert vt.compile_options(False) is None
    assert vt.compile_options(True) == {}
    options = {"backend": "aot_eager", "dynamic": True}
    assert vt.compile_options(options) == options
    for bad in ("inductor", 1, None, ["aot_eager"]):
        with pytest.raises(TypeError, match="compile: expected True, False or a dict"):
            vt.compile_options(bad)
    with pytest.raises(ValueError, match="compile: 'backnd' is not an argument of torch.compile"):
        vt.compile_options({"backnd": "eager"})
    with pytest.raises(ValueError, match="compile: 'model' is not an argument"):
        vt.compile_options({"model": torch.nn.Linear(2, 1)})
    with pytest.raises(ValueError, match="compile: backend 'nope' is not one of torch's"):
        vt.compile_options({"backend": "nope"})
    lock = threading.Lock()
    with pytest.raises(TypeError, match="compile: cannot be serialized"):
        vt.compile_options({"backend": lambda graph, inputs: lock and graph.forward})


def huge():
    """A 64M-parameter model (256 MiB of float32), built only where it is called."""
    with torch.device("meta"):
        return torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)])


def test_a_model_function_pickles_small_whatever_the_models_size():
    def adamw(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-3)

    made = bundle(model=huge, optimizer=vt.with_learning_rate(adamw, 0.01))
    assert len(made) < 20_000  # the functions, not 256 MiB of weights
    objects = loads(made)
    optimizer = objects["optimizer"](torch.nn.Linear(2, 1))
    assert [g["lr"] for g in optimizer.param_groups] == [0.01]  # learning_rate applies
    note = vt.learning_rate_note(objects["optimizer"], None, "none", 2, scheduler=False)
    assert note == "learning rates: those the optimizer function sets on each process"


def test_sharding_refuses_what_it_cannot_combine_with_and_fsdp_wrap_without_it():
    sharded = dict(parallelism="fsdp")
    for change, message in [
        (dict(gradient_compression="fp16"), "gradient_compression: 'fp16' cannot be combined"),
        (dict(gradient_reduction="adasum"), "gradient_reduction: 'adasum' cannot be combined"),
        (dict(compile={}), "compile: torch.compile is not offered with parallelism='fsdp'"),
    ]:
        with pytest.raises(ValueError, match=message):
            vt.check_loop(LoopSpec(**sharded, **change), Y, None)
    with pytest.raises(ValueError, match="fsdp_wrap: applies only with parallelism='fsdp'"):
        vt.check_loop(LoopSpec(fsdp_wrap=("Linear",)), Y, None)
    vt.check_loop(LoopSpec(**sharded, fsdp_wrap=("Linear",), mixed_precision="bf16"), Y, None)
    with pytest.raises(
        ValueError, match=r"fsdp_wrap: the model has no submodule of class \['Block'\]"
    ):
        vt.check_fsdp_wrap(torch.nn.Sequential(torch.nn.Linear(2, 2)), ("Block",))
    vt.check_fsdp_wrap(huge, ("Block",))  # a function: checked where it is built


class NeedsRate(torch.optim.SGD):
    def __init__(self, params, lr):
        super().__init__(params, lr=lr)


def test_an_optimizer_class_is_built_on_the_models_parameters_on_each_rank():
    net = torch.nn.Linear(2, 1)
    built = vt.with_learning_rate(torch.optim.Adam, 0.01)(net)
    assert isinstance(built, torch.optim.Adam) and built.param_groups[0]["lr"] == 0.01
    assert [id(p) for p in built.param_groups[0]["params"]] == [id(p) for p in net.parameters()]
    default = vt.with_learning_rate(torch.optim.Adam, None)
    assert default(net).param_groups[0]["lr"] == 1e-3  # Adam's own default
    bundle(model=lambda: torch.nn.Linear(2, 1), optimizer=default)
    note = vt.learning_rate_note(default, None, "none", 2, scheduler=False)
    assert note.startswith("learning rate 0.001 on each of 2 ranks: torch.optim.Adam's default")
    with pytest.raises(
        ValueError, match="optimizer: NeedsRate has no default lr; set learning_rate"
    ):
        vt.with_learning_rate(NeedsRate, None)
    assert vt.with_learning_rate(NeedsRate, 0.5)(net).param_groups[0]["lr"] == 0.5
