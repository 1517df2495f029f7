"""Executor: one rank's data, the same for both trainers, and the summary the rank returns.

``RankData`` opens the rank's training and validation loaders (``open_loader``) and says how
many batches the rank takes of them: ``steps_per_epoch`` training batches per epoch
(``train_steps_per_epoch``, default one exact pass; the same on every rank, ``StepPlan``)
and its validation batch sizes. ``training_steps`` is the training stream both loops draw
from: seeded passes over the shard, one after another, with no end, cut into epochs and
groups of one optimizer step each, resumable after the batches a run already drew.
``rank_summary`` builds what the rank reports to the driver (``summary.RankSummary``).
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Iterator

from ...shared.spec import SPLITS, TrainSpec
from ...shared.summary import RankSummary
from ..comm.ddp import AdasumState, CompressionState, communicated_dtypes, gradient_path
from ..comm.ranks import RankInfo
from ..comm.shm_allreduce import SharedMemoryAllreduce
from ..decode.decoder import Decoder
from .device_shard import DeviceShard, placement
from .loader import ShardLoader, first_rows, open_loader
from .shards import StepPlan, eval_sizes, shard_rows


def training_steps(
    loader: ShardLoader | DeviceShard,
    plan: StepPlan,
    group: int,
    epoch_steps: int,
    start: int = 0,
) -> Iterator[tuple[dict, float, bool]]:
    """(batch, loss weight, last of its group) for every batch, pass after pass, no end,
    beginning after the first ``start`` batches (those are read, not returned); groups of
    ``group`` batches within epochs of ``epoch_steps`` (``StepPlan.schedule``)."""
    schedule = plan.schedule(group, epoch_steps, start)
    first_pass, skip = divmod(start, plan.steps)
    for pass_index in itertools.count(first_pass + 1):
        chunks = itertools.islice(loader.batches(plan.batch_sizes, pass_index), skip, None)
        for chunk, (weight, last) in zip(chunks, schedule):
            yield chunk, weight, last
        skip = 0


def open_decoder(spec: TrainSpec, info: RankInfo | None = None) -> Decoder | None:
    """The rank's decoder of the data's variable columns (``Decoder``), which has seen the
    first row of the training split, so that it knows each column's decoded shape (for the
    empty batches of a rank without rows), and has started its decode workers; None without
    variable columns."""
    data = spec.data
    if not data.variable:
        return None
    labels = {c.name for c in data.labels}
    decoder = Decoder(
        spec.loader.decode,
        data.columns,
        labels,
        spec.seed,
        data.row_names,
        rank=info.rank if info is not None else 0,
        device=info.device if info is not None else None,
        batch_rows=spec.batch_size,
        local_ranks=info.local_size if info is not None else 1,
    )
    decoder.prime(first_rows(spec, "train"))
    return decoder


class RankData:
    """This rank's loaders of both splits and its batch counts.

    Validation batches are cut one of two ways: ``batch_size`` rows each in order, so ranks
    may run different counts (our loop, whose validation runs no collectives), or with
    ``lockstep`` like a training pass (``StepPlan``), the same count on every rank (a
    Lightning Trainer, whose validation may synchronize logged values). Either way at most
    ``validation_steps_per_epoch`` batches.
    """

    def __init__(self, spec: TrainSpec, info: RankInfo, lockstep: bool):
        world, rank, batch_size = info.world_size, info.rank, spec.batch_size
        pin = info.device.type == "cuda"
        rows = {s: shard_rows(spec.data.rows(s), world, rank) for s in SPLITS}
        on_device, self.placement = placement(spec, rows, info.device, info.local_size)
        hold_on = info.device if on_device else None
        self.decoder = open_decoder(spec, info)  # None without variable columns
        share = self.decoder.share if self.decoder is not None else None
        self.train = open_loader(spec, "train", world, rank, pin, hold_on, share)
        self.plan = StepPlan(spec.data.rows("train"), world, rank, batch_size)
        self.steps_per_epoch = spec.loader.train_steps_per_epoch or self.plan.steps
        self.validation = open_loader(spec, "validation", world, rank, pin, hold_on, share)
        self.has_validation = spec.data.rows("validation") > 0  # on any rank
        most = spec.loader.validation_steps_per_epoch
        if lockstep:
            plan = StepPlan(spec.data.rows("validation"), world, rank, batch_size)
            self.validation_sizes = [s for s in plan.batch_sizes if s][:most]
        else:
            self.validation_sizes = eval_sizes(self.validation.rows, batch_size, most)

    def close(self) -> None:
        if self.decoder is not None:
            self.decoder.close()

    def training_steps(self, group: int, start: int) -> Iterator[tuple[dict, float, bool]]:
        """The training stream in epochs of ``steps_per_epoch`` batches (``training_steps``)."""
        return training_steps(self.train, self.plan, group, self.steps_per_epoch, start)


def peak_memory(device) -> tuple[int, str]:
    """This process's peak memory so far, in bytes, and what was measured: on a GPU the
    most torch allocated there, else the process's peak resident set (RSS)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device), "cuda max allocated"
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cpu peak rss"


def rank_summary(
    info: RankInfo,
    data: RankData,
    hook: CompressionState | AdasumState | SharedMemoryAllreduce | None,
    weights_digest: str,
    parameter_elements: int,
    batches_per_epoch: list[int],
    optimizer_steps_per_epoch: list[int],
    started: float,
    compiled: str | None = None,
    paused: bool = False,
) -> RankSummary:
    """What this rank did: ``hook`` is the DDP gradient hook's state (None without one),
    ``weights_digest`` the final weights' (the same on every rank), ``parameter_elements``
    those this rank held (its shards with FSDP), ``started`` when training began (``time.time()``),
    ``compiled`` the torch.compile backend of the module it trained (None: not compiled),
    ``paused`` whether it stopped at an epoch's end for the job to grow."""
    memory, kind = peak_memory(info.device)
    return RankSummary(
        rank=info.rank,
        local_rank=info.local_rank,
        pid=os.getpid(),
        host=socket.gethostname(),
        device=str(info.device),
        device_note=info.device_note,
        gpu_addresses=list(info.gpu_addresses),
        gradient_path=gradient_path(hook),
        communicated_dtypes=communicated_dtypes(hook),
        gradient_allreduces=hook.calls if hook else None,
        train_rows=data.train.rows,
        validation_rows=data.validation.rows,
        data_placement=data.placement,
        validation_batches_per_epoch=len(data.validation_sizes),
        batches_per_epoch=batches_per_epoch,
        optimizer_steps_per_epoch=optimizer_steps_per_epoch,
        weights_digest=weights_digest,
        parameter_elements=parameter_elements,
        peak_memory_bytes=memory,
        peak_memory_kind=kind,
        seconds=round(time.time() - started, 3),
        compiled=compiled,
        paused=paused,
        rows_skipped=data.decoder.skipped if data.decoder else 0,
        padding=list(data.decoder.padding) if data.decoder else [0, 0],
        decoding=data.decoder.summary() if data.decoder else None,
    )
