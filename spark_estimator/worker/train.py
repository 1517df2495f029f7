"""Executor: the training loop run by every barrier task (one rank each).

Each rank rebuilds model, optimizer and loss from the pickled bundle, wraps the model in
DistributedDataParallel, reads its shard, and trains ``epochs`` epochs on seeded shuffled
batches. Epoch losses are summed locally and averaged across ranks with one allreduce per
epoch. Rank 0 writes a checkpoint after every epoch and the final result to the store.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..serialization import loads, state_dict_digest, state_to_bytes
from ..spec import ColumnSpec, TrainSpec
from .convert import reshape_input
from .loader import TrainBatches, eval_batches, read_shard
from .rendezvous import RankInfo


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
    """The tensors of one batch, moved to the device and shaped for forward()."""

    def __init__(self, shard, index, spec: TrainSpec, device: torch.device):
        shapes = spec.input_shapes or [None] * len(spec.data.features)
        self.size = len(index)
        self.inputs = [
            reshape_input(c.name, shard[c.name][index].to(device), shape)
            for c, shape in zip(spec.data.features, shapes)
        ]
        self.labels = [shard[c.name][index].to(device) for c in spec.data.labels]


def _evaluate(model, loss_fn, shard, rows, spec, device) -> torch.Tensor:
    """Sum of the loss over this rank's validation rows (no collectives)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    model.eval()
    with torch.no_grad():
        for index in eval_batches(rows, spec.batch_size):
            batch = Batch(shard, index, spec, device)
            outputs = as_outputs(model(*batch.inputs))
            loss = compute_loss(loss_fn, outputs, batch.labels, spec.data.labels)
            total += loss.detach().double() * batch.size
    return total


def _rows(shard: dict, columns: list[ColumnSpec]) -> int:
    return len(shard[columns[0].name])


def train(spec: TrainSpec, info: RankInfo) -> dict:
    """Train on this rank; return a summary of what it did (one JSON-able dict)."""
    torch.manual_seed(spec.seed)
    rank, world, device = info.rank, info.world_size, info.device
    model, optimizer, loss_fn = loads(spec.bundle)
    model.to(device)
    optimizer.load_state_dict(optimizer.state_dict())  # moves any optimizer state to device
    if isinstance(loss_fn, torch.nn.Module):
        loss_fn.to(device)
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )

    features = spec.data.features
    train_shard = read_shard(spec.store, spec.data, "train", world, rank)
    val_shard = read_shard(spec.store, spec.data, "validation", world, rank)
    train_rows, val_rows = _rows(train_shard, features), _rows(val_shard, features)
    total_val = spec.data.rows("validation")
    batches = TrainBatches(spec.data.rows("train"), world, rank, spec.batch_size, spec.seed)

    history: list[dict] = []
    output_shapes: list[list[int]] | None = None
    started = time.time()
    for epoch in range(1, spec.epochs + 1):
        ddp.train()
        train_sum = torch.zeros((), dtype=torch.float64, device=device)
        for index, weight in batches.epoch(epoch):
            batch = Batch(train_shard, index, spec, device)
            outputs = as_outputs(ddp(*batch.inputs))
            if output_shapes is None:
                output_shapes = [list(o.shape[1:]) for o in outputs]
            if batch.size:
                loss = compute_loss(loss_fn, outputs, batch.labels, spec.data.labels)
                train_sum += loss.detach().double() * batch.size
            else:  # an empty batch still joins DDP's allreduce, contributing zero gradient
                loss = sum(o.sum() for o in outputs) * 0.0
                weight = 1.0
            optimizer.zero_grad(set_to_none=True)
            (loss * weight).backward()
            optimizer.step()
        val_sum = _evaluate(model, loss_fn, val_shard, val_rows, spec, device)
        sums = torch.stack([train_sum, val_sum])
        dist.all_reduce(sums)  # one collective per epoch for the epoch's metrics
        record = {"epoch": epoch, "train": {"loss": sums[0].item() / spec.data.rows("train")}}
        if total_val:
            record["validation"] = {"loss": sums[1].item() / total_val}
        history.append(record)
        if rank == 0:
            _write_checkpoint(spec, epoch, model, optimizer, history)

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
        "train_rows": train_rows,
        "validation_rows": val_rows,
        "steps_per_epoch": batches.steps,
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
