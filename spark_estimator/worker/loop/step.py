"""Executor: one training step on one batch: forward, loss, backward, optimizer step.

With ``backward_passes_per_step = k`` the optimizer steps once per group of k batches; the
first k - 1 backward passes run under DDP's ``no_sync``, so gradients are accumulated
locally and only the group's last pass communicates. Each batch's loss is scaled by the
weight the step plan gives it, so the group's gradient is the exact mean over the group's
rows on all ranks: k batches of n rows give the gradient of one batch of k x n rows.

``mixed_precision`` runs forward and loss under ``torch.autocast`` in fp16 or bf16 on the
task's device (CUDA, or CPU where torch's CPU autocast is used); fp16 adds a GradScaler.
With ``parallelism="fsdp"`` FSDP's own policy casts instead (``worker.comm.fsdp``), its
``no_sync`` skips the gradients' reduce-scatter, and fp16's scaler is FSDP's, which agrees
across ranks on whether any shard's gradients overflowed.
A ``train_minibatch_fn`` replaces all of this with the user's own step.

With ``compile`` DDP wraps ``torch.compile`` of the model (``compile_module``); the plain
model, whose state dict is checkpointed, stays as it is.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ...shared.spec import PRECISION_DTYPES, LoopSpec, torch_dtype
from ..data.batch import Batch
from .loss import as_outputs
from .objects import TrainingObjects


def compile_module(model: torch.nn.Module, options: dict | None) -> torch.nn.Module:
    """The module ``wrap_model`` wraps for training: ``model`` itself when ``options`` is None,
    else ``torch.compile(model, **options)``. Its forward then runs inside DDP's, where
    dynamo's DDPOptimizer splits the graph at DDP's gradient buckets, so their allreduces
    still overlap backward. Not ``torch.compile`` of the DDP wrapper: DDP's forward breaks
    the graph before calling the model, and dynamo skips the frames of torch's own modules,
    so a ``torch.nn.Linear`` or ``Sequential`` model would silently run uncompiled (torch
    2.13). The compiled module shares the model's parameters; its state dict keys carry an
    ``_orig_mod.`` prefix, so state is read from the plain model."""
    return model if options is None else torch.compile(model, **options)


class Stepper:
    def __init__(
        self,
        ddp: torch.nn.Module,
        objects: TrainingObjects,
        loop: LoopSpec,
        device: torch.device,
    ):
        # DDP's wrapper, or the model itself with one process (nothing to synchronise)
        self.ddp, self.objects, self.device = ddp, objects, device
        self.no_sync = getattr(ddp, "no_sync", contextlib.nullcontext)
        self.accumulate = loop.backward_passes_per_step > 1
        self.step_scheduler = objects.scheduler is not None and loop.lr_scheduler_interval == "step"
        precision = PRECISION_DTYPES.get(loop.mixed_precision)
        self.autocast_dtype = torch_dtype(precision) if precision else None
        self.scaler = torch.amp.GradScaler(device.type) if loop.mixed_precision == "fp16" else None
        if loop.sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            from ..comm import fsdp

            self.no_sync = functools.partial(fsdp.no_sync, ddp)
            self.autocast_dtype = None  # FSDP's policy casts
            if self.scaler is not None:
                self.scaler = ShardedGradScaler(device.type)

    def autocast(self):
        """The autocast context of ``mixed_precision`` (also used for validation)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def __call__(self, batch: Batch, weight: float, last: bool):
        """Train on ``batch``; step the optimizer when ``last`` in its group. Returns the
        model's outputs (a list) and the batch's unweighted loss."""
        if self.objects.train_minibatch_fn is not None:
            outputs, loss = self._custom(batch)
        else:
            sync = last or not self.accumulate
            with contextlib.nullcontext() if sync else self.no_sync():
                with self.autocast():
                    outputs = as_outputs(self.ddp(*batch.inputs))
                    loss = self.objects.loss(outputs, batch.labels, batch.sample_weight)
                scaled = loss if weight == 1.0 else loss * weight
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            if last:
                self._optimizer_step()
        if last and self.step_scheduler:
            self.objects.scheduler.step()
        return outputs, loss

    def _optimizer_step(self) -> None:
        optimizer = self.objects.optimizer
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def _custom(self, batch: Batch):
        def loss_fn(outputs, labels):
            return self.objects.loss(as_outputs(outputs), labels, batch.sample_weight)

        result = self.objects.train_minibatch_fn(
            self.ddp, self.objects.optimizer, loss_fn, batch.inputs, batch.labels
        )
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(
                f"train_minibatch_fn: must return (outputs, loss), got {type(result).__name__}"
            )
        outputs, loss = result
        if not isinstance(loss, torch.Tensor):
            loss = torch.tensor(float(loss), device=self.device)
        return as_outputs(outputs), loss

    def load_state_dict(self, checkpoint: dict) -> None:
        """Take scaler and scheduler state back from a checkpoint."""
        if self.scaler is not None and "scaler" in checkpoint:
            self.scaler.load_state_dict(checkpoint["scaler"])
        if self.objects.scheduler is not None and "lr_scheduler" in checkpoint:
            self.objects.scheduler.load_state_dict(checkpoint["lr_scheduler"])

    def state_dict(self) -> dict:
        """Scaler and scheduler state, for checkpoints."""
        state = {}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        if self.objects.scheduler is not None:
            state["lr_scheduler"] = self.objects.scheduler.state_dict()
        return state
