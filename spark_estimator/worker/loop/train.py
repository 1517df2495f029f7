"""Executor: the training loop run by every barrier task (one rank each).

Each rank rebuilds the user's objects from the pickled bundle (``build_objects``), wraps
the model in DistributedDataParallel (``wrap_model``; DDP broadcasts rank 0's initial
weights), streams its shard through the loader (``RankData``) and trains ``epochs`` epochs.
An epoch is one exact pass over the training rows, or ``train_steps_per_epoch`` batches of
an endless sequence of passes (a batch is one forward and backward pass). With
``backward_passes_per_step = k`` an epoch's batches form groups of k, one optimizer step
each, across pass boundaries; the epoch's last group may be short, so an epoch always ends
with an optimizer step (``StepPlan``). ``Stepper`` does the work of one batch. Per epoch
the ranks run, besides DDP's: a broadcast of rank 0's buffers (``broadcast_buffers``:
BatchNorm's running statistics, which each rank updated on its own last batch), one
allreduce of the epoch's loss and metric sums (``EpochSums``), and one broadcast of rank
0's decision (``AfterEpoch``): go on, stop (callbacks) or pause so the driver can grow the
job (elastic fits). Rank 0 then writes the epoch's checkpoint; with ``commit_every_steps``
the ranks also commit inside the epoch (one gather each time). At the end rank 0 writes
the result, and every rank returns its ``RankSummary``. A run that finds checkpoints of
its ``run_id`` continues after the newest, or from a newer commit.

The loop's other parts are mixins of their own concern: ``SavedState`` (what a checkpoint
or commit holds, written and taken back), ``EpochCommits`` (commits inside an epoch, and
an epoch resumed from one, re-sharded after a resize) and ``LoopResult`` (the end).

With ``parallelism="fsdp"`` the model is sharded over the ranks instead of wrapped in DDP:
checkpoints and commits then hold every rank's shard, validation runs the same number of
batches on every rank (FSDP's forward is a collective), and the result's weights are
gathered to rank 0's CPU.
"""

from __future__ import annotations

import enum
import functools
import itertools
import logging
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ...callbacks import BestModel, TrainingState, monitored_value
from ...shared.serialization import loads
from ...shared.spec import COMMIT_AUTO, TrainSpec, metric_keys
from ...shared.summary import RankSummary
from ..comm.ddp import broadcast_buffers, wrap_model
from ..comm.ranks import RankInfo
from ..comm.shm_allreduce import SharedMemoryAllreduce
from ..data.batch import Batch
from ..data.device_shard import DeviceShard
from ..data.loader import empty_batch
from ..data.prefetch import Prefetched
from ..data.rank_data import RankData
from ..observe.run_log import FLUSH_S
from ..observe.tensorboard import TensorBoardLog
from . import commits
from .checkpoints import Checkpoints
from .commits import EpochCommits
from .loss import as_outputs, batch_metrics
from .metrics import EpochSums, non_finite_loss_error
from .objects import build_objects
from .result import LoopResult
from .resume import agree_on_checkpoint, load_checkpoint, seed_epoch
from .saved_state import SavedState
from .step import Stepper, compile_module

_PLATEAU = torch.optim.lr_scheduler.ReduceLROnPlateau


class AfterEpoch(enum.IntEnum):
    """What every rank does after an epoch, as rank 0 decides it (``_agree_after_epoch``)."""

    ON = 0  # the next epoch
    STOP = 1  # a callback asked to stop training
    PAUSE = 2  # stop for the driver to start the job again with more processes


log = logging.getLogger(__name__)


def train(
    spec: TrainSpec, info: RankInfo, report: Callable[..., None] | None = None
) -> RankSummary:
    """Train on this rank; return a summary of what it did.
    Rank 0 passes its progress to ``report`` (see ``RankLog``)."""
    loop = _TrainingLoop(spec, info, report)
    try:
        loop.run()
        return loop.finish()
    finally:
        loop.steps.close()
        loop.data.close()


class _TrainingLoop(SavedState, EpochCommits, LoopResult):
    """One rank's training run: set up in ``__init__``, ``run`` the epochs, ``finish``."""

    def __init__(self, spec: TrainSpec, info: RankInfo, report: Callable[..., None] | None):
        self.spec, self.info, self.device = spec, info, info.device
        lead = info.rank == 0
        self.report = report if lead else None
        self.reported = 0.0  # when progress was last reported (time.monotonic)
        every = spec.loop.log_every_steps
        self.tensorboard = TensorBoardLog(spec.store, spec.run_id, every) if lead else None
        rank, world = info.rank, info.world_size
        self.objects = build_objects(spec, info)
        fn = spec.loader.transformation_fn
        self.transform = loads(fn) if fn else None
        self.sharded = spec.loop.sharded
        if self.sharded:  # FSDP: the model is its own wrapper (build_objects sharded it)
            self.ddp, self.hook = self.objects.model, None
        else:
            trained = compile_module(self.objects.model, spec.loop.compile)  # model stays plain
            self.ddp, self.hook = wrap_model(
                trained,
                info,
                spec.loop.gradient_compression,
                spec.collective_timeout,
                spec.loop.gradient_reduction,
            )
        self.stepper = Stepper(self.ddp, self.objects, spec.loop, self.device)

        self.data = RankData(spec, info, lockstep=False)
        self.streaming = not isinstance(self.data.train, DeviceShard)
        self.steps_per_epoch = self.data.steps_per_epoch
        # what each epoch of this attempt ran, counted: batches and optimizer steps
        self.batches_run: list[int] = []
        self.optimizer_steps_run: list[int] = []
        self.has_validation = self.data.has_validation

        labels = [c.name for c in spec.data.labels]
        self.metric_names = metric_keys(list(self.objects.metrics), labels)
        self.checkpoints = Checkpoints(spec.store, spec.run_id, spec.keep_checkpoints)
        callbacks = self.objects.callbacks
        self.best = next((cb for cb in callbacks if isinstance(cb, BestModel)), None)
        self.state = TrainingState(rank, world, self.objects.model, self.objects.optimizer)
        self.output_shapes: list[list[int]] | None = None
        self.started = time.time()
        self.start_epoch, self.batches_drawn, self.stopped = 0, 0, False
        self.paused = False  # stopped at an epoch's end for the driver to grow the job
        resume_epoch = agree_on_checkpoint(self.checkpoints, rank, self.device)
        if resume_epoch:
            self._restore(load_checkpoint(self.checkpoints, resume_epoch))
        self._open_commits()
        # the rates training starts with: scaled and scheduled, or restored on resume
        self.start_lrs = [g["lr"] for g in self.objects.optimizer.param_groups]
        self.steps = self.data.training_steps(self.group, self.batches_drawn)
        if self.tensorboard is not None:  # where this launch goes on on the step axis
            into = self.resumed_commit["step"] if self.resumed_commit else 0
            self.tensorboard.start(self.state.history, into, self.batches_drawn)

    # -- the epochs -----------------------------------------------------------------------
    def run(self) -> None:
        callbacks, state = self.objects.callbacks, self.state
        for cb in callbacks:
            cb.on_train_begin(state)
        last = self.start_epoch if self.stopped else self.spec.epochs
        for epoch in range(self.start_epoch + 1, last + 1):
            seed_epoch(self.spec.seed, epoch, self.info.rank)
            state.epoch = epoch
            for cb in callbacks:
                cb.on_epoch_begin(epoch, state)
            lrs = [g["lr"] for g in self.objects.optimizer.param_groups]
            sums = EpochSums(self.metric_names, self.device, self.info.world_size)
            source, first, count = self._epoch_batches(epoch, sums)
            times = self._train_epoch(epoch, sums, source, first, count)
            if not self.sharded:  # the ranks' own running statistics of their last batch
                broadcast_buffers(self.objects.model, self.info.world_size)
            if self.has_validation:
                self._validate(epoch, sums)
            sums.reduce(self.info.rank, times)  # the epoch's one collective for metrics
            if self.spec.loop.terminate_on_nan and sums.non_finite_steps:
                raise self._nan_error(sums, epoch)
            record = {
                "epoch": epoch,
                "num_proc": self.info.world_size,
                "lr": lrs,
                "train": sums.record("train"),
            }
            if self.has_validation:
                record["validation"] = sums.record("validation")
            record["seconds"] = sums.times()
            state.history.append(record)
            self._progress(epoch, self.steps_per_epoch)
            self._step_scheduler(record)
            for cb in callbacks:
                cb.on_epoch_end(epoch, record, state)
            stop, self.paused, self.every = self._agree_after_epoch(
                state.stop_training, epoch < last, self.optimizer_steps_run[-1], times["train"]
            )
            self._write_checkpoint(epoch, stop)
            if self.info.rank == 0:
                self.tensorboard.write(state.history, self.batches_drawn)
            if stop or self.paused:
                break
        if self.paused:  # the driver starts the job again with more processes
            return
        for cb in callbacks:
            cb.on_train_end(state)

    def _progress(self, epoch: int, step: int, sums: EpochSums | None = None) -> None:
        """Report rank 0's progress: at an epoch's end (no ``sums``), else at most every
        FLUSH_S, with the epoch's running loss and the last finished epoch's record."""
        if self.report is None or (sums and time.monotonic() - self.reported < FLUSH_S):
            return
        self.reported = time.monotonic()
        last = self.state.history[-1] if self.state.history else None
        self.report(
            epoch=epoch,
            epochs=self.spec.epochs,
            step=step,
            steps=self.steps_per_epoch,
            loss=sums.running_loss("train") if sums else last["train"]["loss"],
            last=last,
        )

    def _train_epoch(
        self, epoch: int, sums: EpochSums, source, first: int, count: int
    ) -> dict[str, float]:
        """Train on the epoch's ``count`` batches of ``source`` after ``first`` already
        done (``_epoch_batches``); its last one ends a group, so the epoch ends with an
        optimizer step. Returns the seconds of the epoch's training pass
        (``metrics.TIMES``): waiting for batches, computing (on a GPU, until the device has
        done the epoch's work) and averaging gradients where the step waits for it."""
        self.ddp.train()
        shared = self.hook if isinstance(self.hook, SharedMemoryAllreduce) else None
        averaged = shared.seconds if shared else 0.0
        started = time.perf_counter()
        drawn = self._decoded_ahead(itertools.islice(source, count), epoch)
        assemble = functools.partial(self._assemble, epoch=epoch)
        if self.streaming:  # the next batches are made in a thread while this one trains
            steps = Prefetched(drawn, assemble, self.device, lambda made: made[0].tensors())
        else:
            steps = map(assemble, drawn)
        try:
            data, compute = self._run_steps(epoch, sums, steps, first, first + count)
        except BaseException:
            if self.data.decoder is not None:  # first: the batch thread may wait on a worker
                self.data.decoder.close()
            raise
        finally:
            if isinstance(steps, Prefetched):
                steps.close()
        if self.device.type == "cuda":  # the device's queued work is the epoch's computing
            before = time.perf_counter()
            torch.cuda.synchronize(self.device)
            compute += time.perf_counter() - before
        # shared memory: the step waits for it; else DDP overlaps it with the backward pass
        # and what the step waits for of it is counted in computing
        averaged = shared.seconds - averaged if shared else 0.0
        return {
            "train": time.perf_counter() - started,
            "data": data,
            "compute": compute - averaged,
            "communication": averaged,
        }

    def _decoded_ahead(self, drawn, epoch: int):
        """The drawn (chunk, weight, last) of ``epoch`` with the chunk's variable columns
        decoded, a few batches ahead where worker processes decode (``Decoder.ahead``):
        (chunk, weight, last, decoded), decoded None without variable columns."""
        decoder = self.data.decoder
        if decoder is None:
            return ((*d, None) for d in drawn)
        ahead = decoder.ahead(drawn, epoch, lambda d: d[0])
        return ((*d, decoded) for d, decoded in ahead)

    def _assemble(self, drawn: tuple, epoch: int) -> tuple:
        """A drawn (chunk, weight, last, decoded) of ``epoch`` with its batch made: on the
        device (in the loader's thread when streaming); a chunk a transformation_fn will
        change is left as it is."""
        chunk, weight, last, decoded = drawn
        if self.transform is not None:
            return drawn
        decoder = self.data.decoder
        batch = Batch(chunk, self.spec, self.device, None, decoder, epoch, decoded)
        return batch, weight, last

    def _run_steps(
        self, epoch: int, sums: EpochSums, steps, first: int, total: int
    ) -> tuple[float, float]:
        """Train on every (batch, weight, last) of ``steps`` (``_assemble``'s), batches
        ``first`` to ``total`` of the epoch, committing every ``self.every`` optimizer steps
        (after a batch that ends one, never the epoch's last); the seconds spent waiting for
        them and the seconds spent on the rest."""
        objects, check_nan = self.objects, self.spec.loop.terminate_on_nan
        clock = time.perf_counter
        batches = optimizer_steps = 0
        # the optimizer steps before batch ``first`` (a commit's: the end of a group)
        stepped = commits.optimizer_steps(first, self.group)
        data = compute = 0.0
        while True:
            before = clock()
            drawn = next(steps, None)
            if drawn is None:
                break
            batch, weight, last = drawn[:3]
            if not isinstance(batch, Batch):  # with a transformation_fn
                decoder, decoded = self.data.decoder, drawn[3]
                batch = Batch(
                    batch, self.spec, self.device, self.transform, decoder, epoch, decoded
                )
            ready = clock()
            data += ready - before
            batches += 1
            self.batches_drawn += 1
            outputs, loss = self.stepper(batch, weight, last)
            optimizer_steps += last
            if self.output_shapes is None:
                self.output_shapes = [list(o.shape[1:]) for o in outputs]
            self.epoch_rows += batch.drawn  # the rows of the epoch's order it went past
            step = first + batches
            if batch.size:
                metrics = batch_metrics(objects.metrics, outputs, batch.labels)
                sums.add("train", loss, batch.size, metrics, step if check_nan else None)
            if self.tensorboard is not None and self.tensorboard.due(self.batches_drawn):
                lrs = [g["lr"] for g in objects.optimizer.param_groups]
                self.tensorboard.add_step(self.batches_drawn, sums.take_window(), lrs)
            if step < total:  # the epoch's end is reported (and checkpointed) by run()
                self._progress(epoch, step, sums)
                if last and self.every and (stepped + optimizer_steps) % self.every == 0:
                    self._commit(epoch, step, sums)
            compute += clock() - ready
        self.batches_run.append(batches)
        self.optimizer_steps_run.append(optimizer_steps)
        return data, compute

    def _validate(self, epoch: int, sums: EpochSums) -> None:
        """Add this rank's validation batches to ``sums`` (no collectives: ranks may have
        different batch counts, so this runs on the module, not the DDP wrapper; a sharded
        model's forward is a collective: ranks with fewer batches run empty ones)."""
        model, objects = self.objects.model, self.objects
        model.eval()
        sizes = self.data.validation_sizes
        chunks = self.data.validation.batches(sizes, epoch)
        if self.sharded:
            chunks = self._lockstep(chunks, len(sizes))
        decoder = self.data.decoder
        decoded = decoder.ahead(chunks, None) if decoder else ((c, None) for c in chunks)
        with torch.no_grad(), self.stepper.autocast():
            for chunk, result in decoded:
                batch = Batch(chunk, self.spec, self.device, self.transform, decoder, None, result)
                outputs = as_outputs(model(*batch.inputs))
                if not batch.size:
                    continue
                loss = objects.loss(outputs, batch.labels, batch.sample_weight)
                metrics = batch_metrics(objects.metrics, outputs, batch.labels)
                sums.add("validation", loss, batch.size, metrics)

    def _lockstep(self, chunks, count: int):
        """``chunks``, then empty batches up to the most any rank has (one allreduce)."""
        most = torch.tensor([count], device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        yield from chunks
        for _ in range(int(most.item()) - count):
            yield empty_batch(self.spec, "validation")

    def _step_scheduler(self, record: dict) -> None:
        scheduler = self.objects.scheduler
        if scheduler is None or self.spec.loop.lr_scheduler_interval != "epoch":
            return
        if isinstance(scheduler, _PLATEAU):
            split = "validation" if self.has_validation else "train"
            scheduler.step(monitored_value(record, f"{split}.loss"))
        else:
            scheduler.step()

    def _agree_after_epoch(
        self, requested: bool, epochs_left: bool, steps: int, train_s: float
    ) -> tuple[bool, bool, int]:
        """Rank 0's stop request, whether to pause so the driver can start the job again
        with more processes (elastic growth, ``request_growth``), and the next epoch's
        commit interval (``commits.adapted`` of the epoch's ``steps`` optimizer steps in
        ``train_s``), the same on every rank."""
        pause, every = False, self.every
        if self.info.rank == 0:
            if epochs_left and not requested:
                store, grow = self.spec.store, self.spec.store.run(self.spec.run_id).grow
                pause = store.exists(grow) and store.read_json(grow)["from"] == self.info.world_size
            if self.spec.loop.commit_every_steps == COMMIT_AUTO:
                every = commits.adapted(
                    steps, train_s, self.commit_s, self.every, self.epoch_optimizer_steps
                )
        self.commit_s = []
        decision = AfterEpoch.PAUSE if pause else AfterEpoch.STOP if requested else AfterEpoch.ON
        flag = torch.tensor([int(decision), every], dtype=torch.int64, device=self.device)
        dist.broadcast(flag, src=0)
        decision, every = AfterEpoch(int(flag[0])), int(flag[1])
        return decision is AfterEpoch.STOP, decision is AfterEpoch.PAUSE, every

    def _nan_error(self, sums: EpochSums, epoch: int) -> Exception:
        """The error every rank raises when a training loss was not finite this epoch."""
        return non_finite_loss_error(
            epoch,
            sums.first_bad_step,
            sums.non_finite_steps,
            self.info.world_size,
            self.info.rank,
            self.device,
            self.checkpoints.last(),
        )
