"""Executor: the training loop run by every barrier task (one rank each).

Each rank rebuilds model, optimizer and loss from the pickled bundle, wraps the model in
DistributedDataParallel, streams its shard through the loader, and trains ``epochs``
epochs. An epoch is one exact pass over the training rows, or ``train_steps_per_epoch``
steps of an endless sequence of passes. Loss sums and row counts are combined across ranks
with one allreduce per epoch. Rank 0 writes a checkpoint after every epoch and the final
result to the store.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..serialization import loads, state_dict_digest, state_to_bytes
from ..spec import ColumnSpec, TrainSpec
from .convert import reshape_input
from .loader import ShardLoader, chunk_rows, open_loader
from .rendezvous import RankInfo
from .shards import StepPlan, eval_sizes


def as_outputs(output) -> list[torch.Tensor]:
    """A model's return value as a list of tensors, one per output."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)) and all(isinstance(o, torch.Tensor) for o in output):
        return list(output)
    raise TypeError(
        f"model: forward() must return a tensor or a tuple of tensors, got {type(output).__name__}"
    )


def compute_loss(loss_fn, outputs: Sequence[torch.Tensor], labels, label_specs) -> torch.Tensor:
    """Sum of ``loss_fn(output_i, label_i)``, one term per label column.

    A float label with as many values as its output (e.g. shape [B] for an output [B, 1])
    is reshaped to the output's shape, so regression losses do not broadcast silently.
    """
    if len(outputs) != len(labels):
        raise ValueError(
            f"label_cols: the model returned {len(outputs)} outputs for {len(labels)} label "
            f"columns {[s.name for s in label_specs]}; return one output per label column"
        )
    total = None
    for output, label, spec in zip(outputs, labels, label_specs):
        if label.is_floating_point() and label.shape != output.shape:
            if label.numel() == output.numel():
                label = label.view_as(output)
        try:
            term = loss_fn(output, label)
        except Exception as e:
            raise ValueError(
                f"loss: failed on output of shape {tuple(output.shape)} and label column "
                f"'{spec.name}' of shape {tuple(label.shape)} ({type(e).__name__}: {e})"
            ) from e
        total = term if total is None else total + term
    return total


class Batch:
    """The tensors of one batch, transformed, moved to the device and shaped for forward()."""

    def __init__(self, chunk: dict, spec: TrainSpec, device: torch.device, transform=None):
        self.size = chunk_rows(chunk)
        if transform is not None:
            chunk = apply_transformation(transform, chunk, spec.data.columns, self.size)
        shapes = spec.input_shapes or [None] * len(spec.data.features)
        non_blocking = device.type == "cuda"  # the loader's buffer is pinned on GPUs

        def to_device(name):
            return chunk[name].to(device, non_blocking=non_blocking)

        self.inputs = [
            reshape_input(c.name, to_device(c.name), shape)
            for c, shape in zip(spec.data.features, shapes)
        ]
        self.labels = [to_device(c.name) for c in spec.data.labels]


def apply_transformation(fn, chunk: dict, columns: list[ColumnSpec], rows: int) -> dict:
    """``transformation_fn`` on one batch, checked: same columns present, same row count."""
    out = fn(chunk)
    if not isinstance(out, dict):
        raise TypeError(
            f"transformation_fn: must return a dict of tensors, got {type(out).__name__}"
        )
    for c in columns:
        value = out.get(c.name)
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"transformation_fn: the returned dict has no tensor for column '{c.name}'"
            )
        if len(value) != rows:
            raise ValueError(
                f"transformation_fn: column '{c.name}' has {len(value)} rows after the "
                f"transformation, the batch had {rows}; it must keep every row"
            )
    return out


def _evaluate(model, loss_fn, loader, sizes, epoch, spec, device, transform) -> torch.Tensor:
    """[loss sum, rows] over this rank's validation batches (no collectives)."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    model.eval()
    with torch.no_grad():
        for chunk in loader.batches(sizes, epoch):
            batch = Batch(chunk, spec, device, transform)
            outputs = as_outputs(model(*batch.inputs))
            loss = compute_loss(loss_fn, outputs, batch.labels, spec.data.labels)
            total[0] += loss.detach().double() * batch.size
            total[1] += batch.size
    return total


def _training_steps(loader: ShardLoader, plan: StepPlan) -> Iterator[tuple[dict, float]]:
    """(batch, loss weight) for every step, pass after pass, without end."""
    weights = plan.weights()
    for pass_index in itertools.count(1):
        yield from zip(loader.batches(plan.batch_sizes, pass_index), weights)


def train(spec: TrainSpec, info: RankInfo) -> dict:
    """Train on this rank; return a summary of what it did (one JSON-able dict)."""
    torch.manual_seed(spec.seed)
    rank, world, device = info.rank, info.world_size, info.device
    model, optimizer, loss_fn = loads(spec.bundle)
    transform = loads(spec.loader.transformation_fn) if spec.loader.transformation_fn else None
    model.to(device)
    optimizer.load_state_dict(optimizer.state_dict())  # moves any optimizer state to device
    if isinstance(loss_fn, torch.nn.Module):
        loss_fn.to(device)
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )

    pin = device.type == "cuda"
    train_loader = open_loader(spec, "train", world, rank, pin)
    plan = StepPlan(spec.data.rows("train"), world, rank, spec.batch_size)
    steps_per_epoch = spec.loader.train_steps_per_epoch or plan.steps
    steps = _training_steps(train_loader, plan)
    val_loader = open_loader(spec, "validation", world, rank, pin)
    val_sizes = eval_sizes(val_loader.rows, spec.batch_size, spec.loader.validation_steps_per_epoch)
    has_validation = spec.data.rows("validation") > 0

    history: list[dict] = []
    output_shapes: list[list[int]] | None = None
    started = time.time()
    try:
        for epoch in range(1, spec.epochs + 1):
            ddp.train()
            sums = torch.zeros(4, dtype=torch.float64, device=device)
            for chunk, weight in itertools.islice(steps, steps_per_epoch):
                batch = Batch(chunk, spec, device, transform)
                outputs = as_outputs(ddp(*batch.inputs))
                if output_shapes is None:
                    output_shapes = [list(o.shape[1:]) for o in outputs]
                if batch.size:
                    loss = compute_loss(loss_fn, outputs, batch.labels, spec.data.labels)
                    sums[0] += loss.detach().double() * batch.size
                    sums[1] += batch.size
                else:  # an empty batch still joins DDP's allreduce, contributing zero gradient
                    loss = sum(o.sum() for o in outputs) * 0.0
                optimizer.zero_grad(set_to_none=True)
                (loss * weight).backward()
                optimizer.step()
            if has_validation:
                sums[2:] = _evaluate(
                    model, loss_fn, val_loader, val_sizes, epoch, spec, device, transform
                )
            dist.all_reduce(sums)  # one collective per epoch for the epoch's metrics
            record = {"epoch": epoch, "train": {"loss": (sums[0] / sums[1]).item()}}
            if has_validation:
                record["validation"] = {"loss": (sums[2] / sums[3]).item()}
            history.append(record)
            if rank == 0:
                _write_checkpoint(spec, epoch, model, optimizer, history)
    finally:
        steps.close()

    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    if rank == 0:
        result = {"model": state, "history": history, "output_shapes": output_shapes}
        spec.store.write_bytes(spec.store.result_path(spec.run_id), state_to_bytes(result))
    dist.barrier()  # no rank leaves before rank 0 has written the result
    return {
        "rank": rank,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "device": str(device),
        "train_rows": train_loader.rows,
        "validation_rows": val_loader.rows,
        "validation_batches_per_epoch": len(val_sizes) if has_validation else 0,
        "steps_per_epoch": steps_per_epoch,
        "weights_digest": state_dict_digest(state),
        "seconds": round(time.time() - started, 3),
    }


def _write_checkpoint(spec: TrainSpec, epoch: int, model, optimizer, history) -> None:
    checkpoint = {
        "epoch": epoch,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "history": history,
    }
    spec.store.write_bytes(
        spec.store.checkpoint_path(spec.run_id, epoch), state_to_bytes(checkpoint)
    )
