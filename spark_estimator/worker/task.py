"""Executor: the entry point of one barrier task of a fit."""

from __future__ import annotations

from ..spec import TrainSpec
from .rendezvous import process_group
from .train import train


def training_task(spec: TrainSpec) -> dict:
    """Run this task's rank of the training job; return its summary."""
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    with process_group(ctx, spec.use_gpu) as info:
        return train(spec, info)
