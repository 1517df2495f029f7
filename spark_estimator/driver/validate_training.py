"""Driver: checks of the training loop's inputs (the user's objects and loop params).

Like ``validate``: a ValueError or TypeError whose message starts with the parameter at
fault, before any Spark job. ``training_bundle`` returns the one cloudpickle the executors
rebuild everything from (``build_objects``); each object is also pickled on its own
first, so a failure names the parameter that holds the unpicklable thing.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
from collections.abc import Callable

import torch

from ..callbacks import Callback, _Monitor
from ..shared import model_factory
from ..shared.serialization import dumps
from ..shared.spec import (
    GRADIENT_REDUCTIONS,
    LR_SCALINGS,
    PARALLELISMS,
    PRECISIONS,
    SCHEDULER_INTERVALS,
    SPLITS,
    LoopSpec,
    metric_keys,
)
from . import run_manifest
from .param_specs import loss_names


def _check_callable(name: str, value) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{name}: expected a function, got {type(value).__name__}")


def _check_model_and_optimizer(model, optimizer) -> None:
    """A module, or a function that builds one (``shared.model_factory``); an optimizer
    on its parameters, or a function model -> optimizer (needed with a model function)."""
    if not isinstance(model, torch.nn.Module) and not callable(model):
        raise TypeError(
            "model: expected a torch.nn.Module or a function () -> Module, got "
            f"{type(model).__name__}"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        if callable(optimizer):
            return  # called on each rank, on the model as it trains
        raise TypeError(
            "optimizer: expected a torch.optim.Optimizer or a function model -> Optimizer, "
            f"got {type(optimizer).__name__}"
        )
    if model_factory.is_factory(model):
        raise TypeError(
            "optimizer: model is a function, so the optimizer cannot be built on its "
            "parameters here; give a function model -> Optimizer, e.g. "
            "lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3)"
        )
    model_params = {id(p) for p in model.parameters()}
    opt_params = [p for group in optimizer.param_groups for p in group["params"]]
    if not opt_params or any(id(p) not in model_params for p in opt_params):
        raise ValueError(
            "optimizer: its parameters are not the model's parameters; build it with "
            "optimizer_class(model.parameters(), ...) on the same model instance"
        )


def check_losses(loss, loss_constructors, label_cols: list[str]) -> None:
    """Exactly one of ``loss`` / ``loss_constructors``; one or one per label column."""
    if (loss is None) == (loss_constructors is None):
        raise ValueError(
            "loss: set exactly one of loss and loss_constructors"
            + (" (both are set)" if loss is not None else " (neither is set)")
        )
    name, value = ("loss", loss) if loss is not None else ("loss_constructors", loss_constructors)
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if name == "loss_constructors" and not isinstance(value, (list, tuple)):
        raise TypeError("loss_constructors: expected a list of functions () -> loss")
    if len(items) not in (1, len(label_cols)):
        raise ValueError(
            f"{name}: {len(items)} given for {len(label_cols)} label columns {label_cols}; "
            "give one for all label columns or one per label column"
        )
    for item in items:
        if not callable(item):
            what = (
                "a function () -> loss"
                if name == "loss_constructors"
                else "a loss module, a function (output, label) -> scalar tensor, or one of "
                f"the names {loss_names()}"
            )
            raise TypeError(f"{name}: expected {what}, got {item!r}")


def check_metrics(metrics) -> dict[str, Callable] | None:
    """``metrics`` as a dict name -> function (a list is named by ``__name__``)."""
    if metrics is None:
        return None
    if isinstance(metrics, (list, tuple)):
        named = {getattr(fn, "__name__", None): fn for fn in metrics}
        if None in named or "<lambda>" in named or len(named) != len(metrics):
            raise ValueError(
                "metrics: functions in a list are named by __name__, which must be distinct "
                "and not '<lambda>'; pass a dict name -> function instead"
            )
        metrics = named
    if not isinstance(metrics, dict) or not metrics:
        raise TypeError(f"metrics: expected a dict name -> function or a list, got {metrics!r}")
    for name, fn in metrics.items():
        if not isinstance(name, str) or not name or name == "loss" or "." in name:
            raise ValueError(
                f"metrics: {name!r} is not a usable name (non-empty, not 'loss', no '.')"
            )
        if not callable(fn):
            raise TypeError(f"metrics: '{name}' is not a function")
    return dict(metrics)


def class_index_losses(loss, classification: bool, label_cols: list[str]) -> list[bool]:
    """Per label column, whether its loss takes class indices: with ``classification``
    (one label of class indices), or a loss that is torch's CrossEntropyLoss or NLLLoss
    (module or function). Losses from ``loss_constructors`` are not known here."""
    if classification:
        return [True] * len(label_cols)
    losses = loss if isinstance(loss, (list, tuple)) else [loss] * len(label_cols)
    return [_takes_class_indices(fn) for fn in losses]


def _takes_class_indices(fn) -> bool:
    functional = torch.nn.functional
    if isinstance(fn, functools.partial):
        fn = fn.func
    return isinstance(fn, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)) or fn in (
        functional.cross_entropy,
        functional.nll_loss,
    )


def check_loss_weights(loss_weights, label_cols: list[str]) -> None:
    if loss_weights is None:
        return
    loss_weights = list(loss_weights)
    if len(loss_weights) != len(label_cols):
        raise ValueError(
            f"loss_weights: {len(loss_weights)} weights for {len(label_cols)} label columns "
            f"{label_cols}"
        )
    if any(w < 0 for w in loss_weights) or not any(w > 0 for w in loss_weights):
        raise ValueError(f"loss_weights: must be >= 0 with at least one > 0, got {loss_weights}")


def recorded_metrics(
    metric_names: list[str], label_cols: list[str], has_validation: bool
) -> list[str]:
    """What a fit records each epoch, as ``split.name``: the loss and each of the metrics
    ``metric_names`` (per label column where there are several), for the training split
    and, with validation data, the validation split."""
    names = ["loss", *metric_keys(metric_names, label_cols)]
    splits = SPLITS if has_validation else ("train",)
    return [f"{split}.{name}" for split in splits for name in names]


def check_callbacks(callbacks, monitorable: set[str]) -> None:
    """Callbacks are Callback instances; monitored metrics exist (``split.name``)."""
    if callbacks is None:
        return
    if not isinstance(callbacks, (list, tuple)):
        raise TypeError(f"callbacks: expected a list of Callback, got {type(callbacks).__name__}")
    for cb in callbacks:
        if not isinstance(cb, Callback):
            raise TypeError(
                f"callbacks: {cb!r} is not a spark_estimator.callbacks.Callback; subclass it"
            )
        if isinstance(cb, _Monitor) and cb.monitor not in monitorable:
            raise ValueError(
                f"callbacks: {type(cb).__name__} monitors '{cb.monitor}', which this fit does "
                f"not produce; choose one of {sorted(monitorable)}"
            )


def check_loop(loop: LoopSpec, label_cols: list[str], train_minibatch_fn) -> None:
    """The loop params: choices, counts, and what a custom step cannot be combined with."""
    for name, choices in (
        ("lr_scaling", LR_SCALINGS),
        ("gradient_compression", PRECISIONS),
        ("gradient_reduction", GRADIENT_REDUCTIONS),
        ("mixed_precision", PRECISIONS),
        ("lr_scheduler_interval", SCHEDULER_INTERVALS),
        ("parallelism", PARALLELISMS),
    ):
        value = getattr(loop, name)
        if value not in choices:
            raise ValueError(f"{name}: must be one of {list(choices)}, got {value!r}")
    if loop.gradient_reduction == "adasum" and loop.lr_scaling != "none":
        raise ValueError(
            "lr_scaling: must be 'none' with gradient_reduction='adasum' (Adasum does not "
            f"grow the step with the number of processes), got {loop.lr_scaling!r}"
        )
    check_sharding(loop)
    k = loop.backward_passes_per_step
    if k < 1:
        raise ValueError(f"backward_passes_per_step: must be >= 1, got {k}")
    check_loss_weights(loop.loss_weights, label_cols)
    if train_minibatch_fn is not None and (k > 1 or loop.mixed_precision != "none"):
        raise ValueError(
            "train_minibatch_fn: your step owns backward and optimizer.step, so it cannot be "
            "combined with backward_passes_per_step > 1 or mixed_precision; do those in it"
        )


def check_sharding(loop: LoopSpec) -> None:
    """What ``parallelism="fsdp"`` cannot be combined with, and ``fsdp_wrap`` without it."""
    if not loop.sharded:
        if loop.fsdp_wrap:
            raise ValueError(
                f"fsdp_wrap: applies only with parallelism='fsdp' (got {list(loop.fsdp_wrap)} "
                f"with parallelism={loop.parallelism!r})"
            )
        return
    for name, value, plain in (
        ("gradient_compression", loop.gradient_compression, "none"),
        ("gradient_reduction", loop.gradient_reduction, "average"),
    ):
        if value != plain:
            raise ValueError(
                f"{name}: {value!r} cannot be combined with parallelism='fsdp', whose "
                "gradients are reduce-scattered in float32 (mixed_precision='bf16' sets the "
                f"dtype parameters are gathered in); use {name}={plain!r}"
            )
    if loop.compile is not None:
        raise ValueError(
            "compile: torch.compile is not offered with parallelism='fsdp' yet (FSDP's "
            "units would each need compiling); use compile=False"
        )


def check_fsdp_wrap(model, wrap: tuple[str, ...]) -> None:
    """Every class ``fsdp_wrap`` names is a submodule's of ``model`` (a module; a model
    function is checked where it is built, on each rank)."""
    if not wrap or not isinstance(model, torch.nn.Module):
        return
    classes = {type(m).__name__ for m in model.modules() if m is not model}
    missing = sorted(set(wrap) - classes)
    if missing:
        raise ValueError(
            f"fsdp_wrap: the model has no submodule of class {missing}; its submodules' "
            f"classes are {sorted(classes)}"
        )


def compile_options(value) -> dict | None:
    """The ``compile`` param as torch.compile's keyword arguments: None for False (the model
    is not compiled), ``{}`` for True (torch.compile's defaults), or the dict given, whose
    keys must be arguments of ``torch.compile`` (but ``model``), a string ``backend`` one
    torch registers, and the whole picklable (it travels to the executors)."""
    if isinstance(value, bool):
        return {} if value else None
    if not isinstance(value, dict):
        raise TypeError(
            "compile: expected True, False or a dict of torch.compile keyword arguments, "
            f"got {value!r}"
        )
    arguments = set(inspect.signature(torch.compile).parameters) - {"model"}
    for key in value:
        if key not in arguments:
            raise ValueError(
                f"compile: {key!r} is not an argument of torch.compile; use some of "
                f"{sorted(arguments)}"
            )
    backend = value.get("backend")
    if isinstance(backend, str):
        registered = torch.compiler.list_backends(exclude_tags=())
        if backend not in registered:
            raise ValueError(
                f"compile: backend {backend!r} is not one of torch's registered backends "
                f"{registered}; or pass a callable backend"
            )
    dumps(value, "compile")
    return dict(value)


def with_learning_rate(optimizer, learning_rate: float | None):
    """The optimizer a fit trains with: ``optimizer`` itself, or with ``learning_rate`` set
    as every param group's ``lr``, a shallow copy with its own param group dicts (the same
    parameters and state), so the user's optimizer is left as it was. An Optimizer class
    becomes an ``OptimizerClass``, built on each rank."""
    if learning_rate is not None and (not math.isfinite(learning_rate) or learning_rate <= 0):
        raise ValueError(f"learning_rate: must be a finite number > 0, got {learning_rate}")
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return OptimizerClass(optimizer, learning_rate)
    if learning_rate is None:
        return optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        if callable(optimizer):  # the rate is set on what it builds, on each rank
            return WithLearningRate(optimizer, learning_rate)
        return optimizer  # refused, naming optimizer, by training_bundle
    effective = copy.copy(optimizer)
    effective.param_groups = [{**g, "lr": learning_rate} for g in optimizer.param_groups]
    effective.defaults = {**optimizer.defaults, "lr": learning_rate}
    return effective


class OptimizerClass:
    """An Optimizer class given as ``optimizer`` (``torch.optim.Adam``): built on each rank
    on the model's parameters as it trains, with ``learning_rate`` or the class's default
    ``lr``, so it goes with a model given as a function and with sharding."""

    def __init__(self, cls: type, learning_rate: float | None):
        if learning_rate is None and self.default_lr_of(cls) is None:
            raise ValueError(
                f"optimizer: {cls.__name__} has no default lr; set learning_rate, or give "
                f"an optimizer function, e.g. lambda model: {cls.__name__}("
                "model.parameters(), lr=...)"
            )
        self.cls, self.learning_rate = cls, learning_rate
        self.__module__, self.__qualname__ = cls.__module__, cls.__qualname__  # its name

    @staticmethod
    def default_lr_of(cls: type) -> float | None:
        parameter = inspect.signature(cls).parameters.get("lr")
        default = parameter.default if parameter is not None else None
        return float(default) if isinstance(default, (int, float)) else None

    @property
    def rate(self) -> float:
        """The rate every param group starts with."""
        return (
            self.learning_rate if self.learning_rate is not None else self.default_lr_of(self.cls)
        )

    def __call__(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        return self.cls(model.parameters(), lr=self.rate)


class WithLearningRate:
    """An optimizer function whose optimizer's param groups all get ``learning_rate``."""

    def __init__(self, make, learning_rate: float):
        self.make, self.learning_rate = make, learning_rate
        functools.update_wrapper(self, make)  # named as the function (run manifests)

    def __call__(self, model):
        optimizer = self.make(model)
        for group in getattr(optimizer, "param_groups", []):
            group["lr"] = self.learning_rate
        return optimizer


def learning_rate_note(
    optimizer, learning_rate: float | None, lr_scaling: str, num_proc: int, scheduler: bool
) -> str:
    """The line a fit logs first: the learning rate each rank starts with, and why (the
    optimizer's or ``learning_rate``'s, times ``num_proc`` with ``lr_scaling='linear'``);
    without scaling, what Horovod's estimator (which always scales) would use instead. An
    optimizer function's rates are known only where it is called, unless ``learning_rate``
    sets them."""
    source = "learning_rate's" if learning_rate is not None else "the optimizer's"
    if isinstance(optimizer, OptimizerClass) and learning_rate is None:
        source = f"{run_manifest.public_name(optimizer.cls)}'s default"
        optimizer = torch.optim.SGD([torch.zeros(1)], lr=optimizer.rate)  # only its rate
    elif not isinstance(optimizer, torch.optim.Optimizer):
        if learning_rate is None:
            scaled = f" x {num_proc} (lr_scaling='linear')" if lr_scaling == "linear" else ""
            return f"learning rates: those the optimizer function sets on each process{scaled}"
        optimizer = torch.optim.SGD([torch.zeros(1)], lr=learning_rate)  # only its rate
    given = [g["lr"] for g in optimizer.param_groups]

    def rates(values: list[float]) -> str:
        shown = [f"{v:.6g}" for v in values]
        return shown[0] if len(shown) == 1 else f"[{', '.join(shown)}]"

    noun = "learning rate" if len(given) == 1 else "learning rates"
    ranks = f"{num_proc} rank{'s' if num_proc > 1 else ''}"
    scaled = rates([lr * num_proc for lr in given])
    if lr_scaling == "linear":
        line = (
            f"{noun} {scaled} on each of {ranks}: {source} {rates(given)} x {num_proc} "
            "(lr_scaling='linear', as Horovod's estimator)"
        )
    elif num_proc > 1:
        line = (
            f"{noun} {rates(given)} on each of {ranks}: {source} {rates(given)} as given "
            f"(lr_scaling='none'; Horovod's estimator would use {scaled}: set lr_scaling='linear')"
        )
    else:
        line = f"{noun} {rates(given)} on 1 rank: {source} as given"
    return line + ("; the lr_scheduler changes it from there" if scheduler else "")


def training_bundle(
    objects: dict, label_cols: list[str], lr_scheduler_interval: str
) -> tuple[bytes, dict[str, Callable] | None]:
    """Check the user's objects; return their one cloudpickle for the executors, and the
    metrics as checked (``check_metrics``).

    ``objects`` has the estimator's values of model, optimizer, loss, loss_constructors,
    metrics, lr_scheduler, callbacks and train_minibatch_fn.
    """
    _check_model_and_optimizer(objects["model"], objects["optimizer"])
    check_losses(objects["loss"], objects["loss_constructors"], label_cols)
    for name in ("lr_scheduler", "train_minibatch_fn"):
        _check_callable(name, objects[name])
    objects = {**objects, "metrics": check_metrics(objects["metrics"])}
    for name, value in objects.items():
        if name != "optimizer":  # the one left unchecked: a failure of the last pickle
            dumps(value, name)
    if isinstance(objects["optimizer"], torch.optim.Optimizer):  # else built on each rank
        _check_scheduler(objects["lr_scheduler"], objects["optimizer"], lr_scheduler_interval)
    return dumps(objects, "optimizer"), objects["metrics"]


def _check_scheduler(make_scheduler, optimizer, interval: str) -> None:
    """Build the scheduler once on a shallow copy of the optimizer with its own param group
    dicts (schedulers write ``initial_lr`` there), so a wrong function fails here rather
    than on every executor, and the user's optimizer is left as it was. ReduceLROnPlateau
    steps on an epoch's loss, so it is refused with ``lr_scheduler_interval="step"``."""
    if make_scheduler is None:
        return
    probe = copy.copy(optimizer)
    probe.param_groups = [dict(group) for group in optimizer.param_groups]
    try:
        scheduler = make_scheduler(probe)
    except Exception as e:
        raise ValueError(
            f"lr_scheduler: calling it with the optimizer failed ({type(e).__name__}: {e})"
        ) from e
    if not hasattr(scheduler, "step") or not hasattr(scheduler, "state_dict"):
        raise TypeError(
            f"lr_scheduler: must return a torch LR scheduler, got {type(scheduler).__name__}"
        )
    if interval == "step" and isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError(
            "lr_scheduler_interval: 'step' cannot drive ReduceLROnPlateau, which steps on the "
            "epoch's validation (or training) loss; use lr_scheduler_interval='epoch'"
        )
