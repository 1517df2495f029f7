"""Executor: the user's objects rebuilt from the pickled bundle, ready on the device.

The driver pickles one dict (``training_bundle``): model and optimizer in the
same pickle, so the optimizer's param groups refer to the model's parameters after
unpickling, whatever its constructor arguments. A model given as a function is built here
(``shared.model_factory``), seeded alike on every rank, and an optimizer given as a
function is called on the model as it trains. Here the model moves to the device (or, with
``parallelism="fsdp"``, is sharded: ``shard_model``; then an optimizer object is built
anew on the shards, from its class, defaults and param groups by parameter name), the
learning rates are scaled (``lr_scaling``), losses are built (``loss_constructors`` run
here, for losses that cannot be pickled), and then the LR scheduler is built on the
scaled optimizer.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...shared import model_factory
from ...shared.serialization import loads
from ...shared.spec import TrainSpec
from ..comm.ranks import RankInfo
from .loss import BatchLoss


@dataclass
class TrainingObjects:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss: BatchLoss
    base_lrs: list[float]  # the optimizer's learning rates before lr_scaling
    metrics: dict[str, Callable] = field(default_factory=dict)
    scheduler: object | None = None
    callbacks: list = field(default_factory=list)
    train_minibatch_fn: Callable | None = None


def scale_learning_rates(optimizer: torch.optim.Optimizer, factor: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor


def rescale_restored(objects: TrainingObjects, factor: float) -> None:
    """Scale the rates restored from a checkpoint written with another number of
    processes, ``lr_scaling="linear"``: the optimizer's, and those an LR scheduler starts
    from (``initial_lr``, ``base_lrs``), so the schedule goes on at the new scale."""
    scale_learning_rates(objects.optimizer, factor)
    for group in objects.optimizer.param_groups:
        if "initial_lr" in group:
            group["initial_lr"] = group["initial_lr"] * factor
    scheduler = objects.scheduler
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]


def take_new_rates(objects: TrainingObjects, world_size: int, linear: bool) -> None:
    """Train on at this fit's rates (``base_lrs``, times ``world_size`` with
    ``lr_scaling="linear"``) instead of those restored from a checkpoint trained at others:
    the optimizer's, and those an LR scheduler schedules from (``initial_lr``,
    ``base_lrs``), so a schedule goes on from the new rates."""
    rates = [lr * (world_size if linear else 1) for lr in objects.base_lrs]
    for group, lr in zip(objects.optimizer.param_groups, rates):
        group["lr"] = lr
        if "initial_lr" in group:
            group["initial_lr"] = lr
    scheduler = objects.scheduler
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = list(rates)
    if scheduler is not None and hasattr(scheduler, "_last_lr"):
        scheduler._last_lr = list(rates)


def build_losses(loss, loss_constructors, num_labels: int) -> list[Callable]:
    """One loss per label column: ``loss`` (one for all, or a list), or built here by
    calling ``loss_constructors`` (one for all, or one per label column)."""
    if loss_constructors is not None:
        loss = [make() for make in loss_constructors]
    losses = list(loss) if isinstance(loss, (list, tuple)) else [loss]
    return losses * num_labels if len(losses) == 1 else losses


def group_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The names of the parameters of each of ``optimizer``'s param groups in ``model``."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def rebuilt(
    optimizer: torch.optim.Optimizer, names: list[list[str]], model
) -> torch.optim.Optimizer:
    """``optimizer``'s class with its defaults and param groups (their options, and their
    parameters by name: ``names``) on ``model``'s parameters as they are now (sharded)."""
    params = dict(model.named_parameters())
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [params[n] for n in ns]}
        for group, ns in zip(optimizer.param_groups, names)
    ]
    return type(optimizer)(groups, **optimizer.defaults)


def called(make_optimizer, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer a function model -> optimizer builds on ``model``."""
    optimizer = make_optimizer(model)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "optimizer: the function must return a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}"
        )
    return optimizer


def model_and_optimizer(
    spec: TrainSpec, info: RankInfo, model, optimizer
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model on this rank's device (sharded with FSDP) and its optimizer."""
    device = info.device
    torch.manual_seed(spec.seed)  # a model built here starts alike on every rank
    model = model_factory.build(model)
    names = group_names(model, optimizer) if isinstance(optimizer, torch.optim.Optimizer) else None
    meta = model_factory.on_meta(model)
    if spec.loop.sharded:
        if not meta:
            model.to(device)
        from ..comm.fsdp import shard_model  # torch's FSDP: imported by sharded fits only

        job = "job-" + hashlib.sha256(spec.secret.encode()).hexdigest()[:12]
        shard_model(model, info, spec.loop.fsdp_wrap, spec.loop.mixed_precision, job)
    if meta:
        # a CPU mesh draws each shard's values from its rank's generator (no DTensor RNG
        # there): seeded per rank, else every shard would start with the same values
        torch.manual_seed(spec.seed * 1_000_003 + info.rank)
        with warnings.catch_warnings():  # torch's warning of just that, on every rank
            warnings.filterwarnings("ignore", message="DTensor random operators may not")
            model_factory.materialize(model, device)
    model.to(device)
    if names is None:
        return model, called(optimizer, model)
    if spec.loop.sharded:
        return model, rebuilt(optimizer, names, model)
    optimizer.load_state_dict(optimizer.state_dict())  # moves any optimizer state to device
    return model, optimizer


def build_objects(spec: TrainSpec, info: RankInfo) -> TrainingObjects:
    objects = loads(spec.bundle)
    model, optimizer = model_and_optimizer(spec, info, objects["model"], objects["optimizer"])
    world_size, device = info.world_size, info.device
    base_lrs = [group["lr"] for group in optimizer.param_groups]
    if spec.loop.lr_scaling == "linear":
        scale_learning_rates(optimizer, world_size)
    losses = build_losses(objects["loss"], objects.get("loss_constructors"), len(spec.data.labels))
    for loss_fn in losses:
        if isinstance(loss_fn, torch.nn.Module):
            loss_fn.to(device)
    make_scheduler = objects.get("lr_scheduler")
    return TrainingObjects(
        model=model,
        optimizer=optimizer,
        loss=BatchLoss(
            losses,
            spec.data.labels,
            spec.loop.loss_weights,
            weighted_rows=spec.data.sample_weight is not None,
        ),
        base_lrs=base_lrs,
        metrics=dict(objects.get("metrics") or {}),
        scheduler=make_scheduler(optimizer) if make_scheduler else None,
        callbacks=list(objects.get("callbacks") or []),
        train_minibatch_fn=objects.get("train_minibatch_fn"),
    )
