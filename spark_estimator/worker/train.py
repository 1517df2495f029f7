"""Executor: the training loop run by every barrier task (one rank each).

Each rank rebuilds the user's objects from the pickled bundle (``objects.py``), wraps the
model in DistributedDataParallel (``ddp.py``; DDP broadcasts rank 0's initial weights),
streams its shard through the loader and trains ``epochs`` epochs. An epoch is one exact
pass over the training rows, or ``train_steps_per_epoch`` batches of an endless sequence
of passes; ``step.py`` does the work of one batch. Per epoch the ranks run exactly two
collectives besides DDP's: one allreduce of the epoch's loss and metric sums
(``metrics.py``), and one broadcast of rank 0's decision to stop (callbacks). Rank 0 then
writes the epoch's checkpoint (``checkpoints.py``); at the end it writes the result.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from ..callbacks import BestModel, EarlyStopping, TrainingState, monitored_value
from ..serialization import loads, state_dict_digest, state_to_bytes
from ..spec import TrainSpec, metric_keys
from .batch import Batch
from .checkpoints import Checkpoints
from .ddp import wrap_model
from .loader import ShardLoader, open_loader
from .loss import as_outputs, batch_metrics
from .metrics import EpochSums
from .objects import TrainingObjects, build_objects
from .rendezvous import RankInfo
from .shards import StepPlan, eval_sizes
from .step import Stepper

_PLATEAU = torch.optim.lr_scheduler.ReduceLROnPlateau


def training_steps(
    loader: ShardLoader, plan: StepPlan, group: int
) -> Iterator[tuple[dict, float, bool]]:
    """(batch, loss weight, last of its group) for every step, pass after pass, no end."""
    weights, ends = plan.weights(group), plan.group_ends(group)
    for pass_index in itertools.count(1):
        yield from zip(loader.batches(plan.batch_sizes, pass_index), weights, ends)


def _evaluate(
    objects: TrainingObjects,
    stepper: Stepper,
    loader,
    sizes,
    epoch,
    spec,
    device,
    transform,
    sums: EpochSums,
) -> None:
    """Add this rank's validation batches to ``sums`` (no collectives)."""
    model = objects.model
    model.eval()
    with torch.no_grad(), stepper.autocast():
        for chunk in loader.batches(sizes, epoch):
            batch = Batch(chunk, spec, device, transform)
            outputs = as_outputs(model(*batch.inputs))
            loss = objects.loss(outputs, batch.labels, batch.sample_weight)
            metrics = batch_metrics(objects.metrics, outputs, batch.labels)
            sums.add("validation", loss, batch.size, metrics)


def _nan_error(sums: EpochSums, epoch: int, world: int, checkpoints: Checkpoints) -> Exception:
    """The error every rank raises when a training loss was not finite in this epoch."""
    # the first bad step over all ranks, ties to the lowest rank: step * world + rank
    first = sums.first_bad_step
    code = first * world + dist.get_rank() if first >= 0 else torch.iinfo(torch.int64).max
    code = torch.tensor([int(code)], dtype=torch.int64, device=first.device)
    dist.all_reduce(code, op=dist.ReduceOp.MIN)
    step, rank = divmod(int(code.item()), world)
    last = checkpoints.last()
    kept = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
    return FloatingPointError(
        f"terminate_on_nan: the training loss was NaN or infinite at epoch {epoch}, step "
        f"{step} (rank {rank}; {sums.non_finite_steps} such steps this epoch); training "
        f"stopped and {kept}"
    )


def _agree_to_stop(requested: bool, device: torch.device) -> bool:
    """Rank 0's stop request, the same on every rank."""
    flag = torch.tensor([1.0 if requested else 0.0], device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def train(spec: TrainSpec, info: RankInfo) -> dict:
    """Train on this rank; return a summary of what it did (one JSON-able dict)."""
    torch.manual_seed(spec.seed)
    rank, world, device = info.rank, info.world_size, info.device
    loop = spec.loop
    objects = build_objects(spec, world, device)
    transform = loads(spec.loader.transformation_fn) if spec.loader.transformation_fn else None
    ddp, compression = wrap_model(objects.model, device, loop.gradient_compression)
    stepper = Stepper(ddp, objects, loop, device)
    optimizer, scheduler, callbacks = objects.optimizer, objects.scheduler, objects.callbacks

    pin = device.type == "cuda"
    train_loader = open_loader(spec, "train", world, rank, pin)
    plan = StepPlan(spec.data.rows("train"), world, rank, spec.batch_size)
    group = loop.backward_passes_per_step
    steps_per_epoch = spec.loader.train_steps_per_epoch or plan.steps
    optimizer_steps = math.ceil(steps_per_epoch / group)
    steps = training_steps(train_loader, plan, group)
    val_loader = open_loader(spec, "validation", world, rank, pin)
    val_sizes = eval_sizes(val_loader.rows, spec.batch_size, spec.loader.validation_steps_per_epoch)
    has_validation = spec.data.rows("validation") > 0
    names = metric_keys(list(objects.metrics), [c.name for c in spec.data.labels])
    checkpoints = Checkpoints(spec.store, spec.run_id, loop.keep_checkpoints)
    best = next((cb for cb in callbacks if isinstance(cb, BestModel)), None)
    state = TrainingState(rank, world, objects.model, optimizer)
    history = state.history
    output_shapes: list[list[int]] | None = None
    start_lrs = [group["lr"] for group in optimizer.param_groups]
    started = time.time()
    try:
        for cb in callbacks:
            cb.on_train_begin(state)
        for epoch in range(1, spec.epochs + 1):
            state.epoch = epoch
            for cb in callbacks:
                cb.on_epoch_begin(epoch, state)
            lrs = [g["lr"] for g in optimizer.param_groups]
            sums = EpochSums(names, device)
            ddp.train()
            done = step = 0
            for chunk, weight, last in steps:
                step += 1
                batch = Batch(chunk, spec, device, transform)
                outputs, loss = stepper(batch, weight, last)
                if output_shapes is None:
                    output_shapes = [list(o.shape[1:]) for o in outputs]
                if batch.size:
                    metrics = batch_metrics(objects.metrics, outputs, batch.labels)
                    sums.add("train", loss, batch.size, metrics)
                    if loop.terminate_on_nan:
                        sums.check_finite(loss, step)
                done += last
                if done == optimizer_steps:
                    break
            if has_validation:
                _evaluate(
                    objects, stepper, val_loader, val_sizes, epoch, spec, device, transform, sums
                )
            sums.reduce()  # the epoch's one collective for loss and metrics
            if loop.terminate_on_nan and sums.non_finite_steps:
                raise _nan_error(sums, epoch, world, checkpoints)
            record = {"epoch": epoch, "lr": lrs, "train": sums.record("train")}
            if has_validation:
                record["validation"] = sums.record("validation")
            history.append(record)
            if scheduler is not None and loop.lr_scheduler_interval == "epoch":
                if isinstance(scheduler, _PLATEAU):
                    split = "validation" if has_validation else "train"
                    scheduler.step(monitored_value(record, f"{split}.loss"))
                else:
                    scheduler.step()
            for cb in callbacks:
                cb.on_epoch_end(epoch, record, state)
            stop = _agree_to_stop(state.stop_training, device)
            if rank == 0:
                checkpoint = {
                    "model": objects.model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "history": history,
                    **stepper.state_dict(),
                }
                protected = {best.best_epoch} if best and best.best_epoch else set()
                checkpoints.write(epoch, checkpoint, protected)
            if stop:
                break
        for cb in callbacks:
            cb.on_train_end(state)
    finally:
        steps.close()

    state_dict = {k: v.detach().to("cpu") for k, v in objects.model.state_dict().items()}
    if rank == 0:
        selection = best.selection() if best else None
        summary = {
            "world_size": world,
            "lr_scaling": loop.lr_scaling,
            "base_learning_rates": objects.base_lrs,
            "learning_rates": start_lrs,
            "backward_passes_per_step": group,
            "gradient_compression": loop.gradient_compression,
            "mixed_precision": loop.mixed_precision,
            "epochs_run": len(history),
            "stopped_early": len(history) < spec.epochs,
            "early_stopping_epoch": next(
                (
                    cb.stopped_epoch
                    for cb in callbacks
                    if isinstance(cb, EarlyStopping) and cb.stopped_epoch
                ),
                None,
            ),
            "selected_epoch": selection["epoch"] if selection else len(history),
            "selection": selection,
            "checkpoints": checkpoints.epochs(),
        }
        result = {
            "model": best.best_state if selection else state_dict,
            "history": history,
            "output_shapes": output_shapes,
            "summary": summary,
        }
        spec.store.write_bytes(spec.store.result_path(spec.run_id), state_to_bytes(result))
    dist.barrier()  # no rank leaves before rank 0 has written the result
    return {
        "rank": rank,
        "local_rank": info.local_rank,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "device": str(device),
        "device_note": info.device_note,
        "communicated_dtypes": sorted(compression.sent) if compression else None,
        "gradient_allreduces": compression.calls if compression else None,
        "train_rows": train_loader.rows,
        "validation_rows": val_loader.rows,
        "validation_batches_per_epoch": len(val_sizes) if has_validation else 0,
        "steps_per_epoch": steps_per_epoch,
        "optimizer_steps_per_epoch": optimizer_steps,
        "weights_digest": state_dict_digest(state_dict),
        "seconds": round(time.time() - started, 3),
    }
