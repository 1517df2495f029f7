"""Executor: the user's objects rebuilt from the pickled bundle, ready on the device.

The driver pickles one dict (``driver/validate_training.py``): model and optimizer in the
same pickle, so the optimizer's param groups refer to the model's parameters after
unpickling, whatever its constructor arguments. Here the model moves to the device, the
learning rates are scaled (``lr_scaling``), losses are built (``loss_constructors`` run
here, for losses that cannot be pickled), and then the LR scheduler is built on the
scaled optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...shared.serialization import loads
from ...shared.spec import TrainSpec
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


def build_losses(loss, loss_constructors, num_labels: int) -> list[Callable]:
    """One loss per label column: ``loss`` (one for all, or a list), or built here by
    calling ``loss_constructors`` (one for all, or one per label column)."""
    if loss_constructors is not None:
        loss = [make() for make in loss_constructors]
    losses = list(loss) if isinstance(loss, (list, tuple)) else [loss]
    return losses * num_labels if len(losses) == 1 else losses


def build_objects(spec: TrainSpec, world_size: int, device: torch.device) -> TrainingObjects:
    objects = loads(spec.bundle)
    model, optimizer = objects["model"], objects["optimizer"]
    model.to(device)
    optimizer.load_state_dict(optimizer.state_dict())  # moves any optimizer state to device
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
