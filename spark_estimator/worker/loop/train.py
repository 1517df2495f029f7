"""Executor: the training loop run by every barrier task (one rank each).

Each rank rebuilds the user's objects from the pickled bundle (``objects.py``), wraps the
model in DistributedDataParallel (``ddp.py``; DDP broadcasts rank 0's initial weights),
streams its shard through the loader (``rank_data.py``) and trains ``epochs`` epochs. An
epoch is one exact pass over the training rows, or ``train_steps_per_epoch`` batches of an
endless sequence of passes (a batch is one forward and backward pass). With
``backward_passes_per_step = k`` an epoch's batches form groups of k, one optimizer step
each, across pass boundaries; the epoch's last group may be short, so an epoch always ends
with an optimizer step (``shards.py``). ``step.py`` does the work of one batch. Per epoch
the ranks run exactly two collectives besides DDP's: one allreduce of the epoch's loss and
metric sums (``metrics.py``), and one broadcast of rank 0's decision to stop (callbacks)
or to pause so the driver can grow the job (elastic fits). Rank 0 then writes the epoch's
checkpoint (``checkpoints.py``); with ``commit_every_steps`` the ranks also commit inside
the epoch (one gather each time, ``commits.py``). At the end rank 0 writes the result, and
every rank returns its ``RankSummary``. A run that finds checkpoints of its ``run_id``
continues after the newest, or from a newer commit (``resume.py``).

With ``parallelism="fsdp"`` the model is sharded over the ranks instead of wrapped in DDP
(``comm/fsdp.py``): checkpoints and commits then hold every rank's shard
(``sharded.py``), validation runs the same number of batches on every rank (FSDP's
forward is a collective), and the result's weights are gathered to rank 0's CPU.
"""

from __future__ import annotations

import functools
import itertools
import logging
import posixpath
import time
import uuid
from collections.abc import Callable

import torch
import torch.distributed as dist

from ...callbacks import BestModel, EarlyStopping, TrainingState, monitored_value
from ...shared.serialization import loads, state_dict_digest, state_to_bytes
from ...shared.spec import COMMIT_AUTO, TrainSpec, compile_backend, metric_keys
from ...shared.summary import RankSummary, seconds_per_rank, training_summary
from ..comm.ddp import wrap_model
from ..comm.rendezvous import RankInfo
from ..comm.shm_allreduce import SharedMemoryAllreduce
from ..data.batch import Batch
from ..data.device_shard import DeviceShard
from ..data.loader import empty_batch
from ..data.prefetch import Prefetched
from ..data.rank_data import RankData, rank_summary
from ..data.remainder import own_runs
from ..observe.run_log import FLUSH_S
from ..observe.tensorboard import TensorBoardLog
from . import commits
from .checkpoints import SHARDS, Checkpoints
from .loss import as_outputs, batch_metrics
from .metrics import EpochSums, non_finite_loss_error
from .objects import build_objects, rescale_restored, take_new_rates
from .resume import (
    agree_on_checkpoint,
    callback_states,
    continue_stopped,
    load_checkpoint,
    restore_callbacks,
    seed_epoch,
)
from .step import Stepper, compile_module

_PLATEAU = torch.optim.lr_scheduler.ReduceLROnPlateau
log = logging.getLogger(__name__)


def train(
    spec: TrainSpec, info: RankInfo, report: Callable[..., None] | None = None
) -> RankSummary:
    """Train on this rank; return a summary of what it did.
    Rank 0 passes its progress to ``report`` (see run_log.py)."""
    loop = _TrainingLoop(spec, info, report)
    try:
        loop.run()
        return loop.finish()
    finally:
        loop.steps.close()
        loop.data.close()


class _TrainingLoop:
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
        if self.sharded:  # FSDP: the model is its own wrapper (objects.py sharded it)
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
        # commits inside an epoch (commits.py): the one to resume from, the interval (in
        # optimizer steps: an epoch's batches form groups of backward_passes_per_step)
        self.commit_path = spec.store.run(spec.run_id).step_commit
        self.group = spec.loop.backward_passes_per_step
        self.epoch_optimizer_steps = commits.optimizer_steps(self.steps_per_epoch, self.group)
        self.every = commits.interval(spec.loop.commit_every_steps, self.epoch_optimizer_steps)
        self.commit_s: list[float] = []  # this epoch's commits' seconds (rank 0's)
        self.commits_made, self.commit_seconds = 0, 0.0
        self.commit = None
        if spec.loop.commit_every_steps:
            self.commit = commits.agree(
                spec.store, self.commit_path, rank, self.start_epoch, self.device
            )
        if self.commit is not None and not self._can_reshard(self.commit):
            self.commit = None  # the epoch's checkpoint is where this size can go on from
        self.resumed_commit = None  # {"epoch", "step"} of the commit this launch went on from
        if self.commit is not None:
            self._restore(self.commit)
            self.resumed_commit = {"epoch": self.commit["epoch"], "step": self.commit["step"]}
        # the rates training starts with: scaled and scheduled, or restored on resume
        self.start_lrs = [g["lr"] for g in self.objects.optimizer.param_groups]
        self.steps = self.data.training_steps(self.group, self.batches_drawn)
        self.epoch_runs, self.epoch_rows, self.resharded, self.sources = [], 0, False, None
        if self.tensorboard is not None:  # where this launch goes on on the step axis
            into = self.resumed_commit["step"] if self.resumed_commit else 0
            self.tensorboard.start(self.state.history, into, self.batches_drawn)

    def _can_reshard(self, commit: dict) -> bool:
        """Whether this launch can go on from ``commit``: with its number of processes, or
        with another when an epoch is one pass (its rows can be re-sharded)."""
        same = commit["world_size"] == self.info.world_size and not commit["resharded"]
        return same or self.spec.loader.train_steps_per_epoch is None

    def _restore(self, saved: dict) -> None:
        """Continue from an epoch's checkpoint (see resume.py) or from a commit inside the
        next epoch (commits.py), which holds the same keys and the epoch's position."""
        epoch = saved["epoch"]
        objects, store = self.objects, self.spec.store
        if SHARDS in saved:
            from . import sharded

            folder = store.run(self.spec.run_id).shards(saved[SHARDS])
            sharded.load(store, folder, objects.model, objects.optimizer)
        else:
            objects.model.load_state_dict(saved["model"])
            objects.optimizer.load_state_dict(saved["optimizer"])
        self.stepper.load_state_dict(saved)
        restore_callbacks(objects.callbacks, saved["callbacks"])
        if self.best is not None and self.best.best_epoch is not None:
            best = self.best.best_epoch
            if SHARDS in saved:  # the best epoch's checkpoint is never pruned
                from . import sharded

                folder = self.checkpoints.shards(best)
                self.best.best_state = sharded.model_state(store, folder, objects.model)
            else:
                source = saved if best == epoch else load_checkpoint(self.checkpoints, best)
                self.best.best_state = source["model"]
        self.state.history = list(saved["history"])
        self.output_shapes = saved["output_shapes"]
        self.batches_drawn = saved["batches_drawn"]
        self.stopped = saved["stop_training"]
        # a commit is inside its epoch: the loop starts that epoch again from its position
        self.start_epoch = epoch - 1 if "step" in saved else epoch
        if self.stopped and "step" not in saved and epoch == self.spec.further_from:
            self.stopped = False  # a finished run stopped early, trained further
            continue_stopped(objects.callbacks, epoch, self.info.rank)
        saved_world = saved.get("world_size", self.info.world_size)
        linear = self.spec.loop.lr_scaling == "linear"
        if saved_world != self.info.world_size:  # an elastic fit started again resized
            if linear:
                rescale_restored(objects, self.info.world_size / saved_world)
            # the stream of passes goes on as if this size had trained from the start (a
            # commit's epoch ends on its re-sharded rows: the stream starts after it)
            self.batches_drawn = epoch * self.steps_per_epoch
        trained_at = saved.get("base_lrs")  # None in checkpoints written before they were
        if trained_at is not None and trained_at != objects.base_lrs:
            take_new_rates(objects, self.info.world_size, linear)
            if self.info.rank == 0:
                log.info(
                    "learning rates %s (this fit's) replace the run's %s from epoch %d",
                    objects.base_lrs,
                    trained_at,
                    self.start_epoch + 1,
                )

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

    def _epoch_batches(self, epoch: int, sums: EpochSums) -> tuple:
        """Where the epoch's batches come from: (stream, steps already done, steps to do).
        Normally the stream of passes, all ``steps_per_epoch``; in the epoch of a commit
        the rest of it (commits.py): the same stream after the commit's step, or the rows
        not yet trained on, re-sharded over this launch's ranks."""
        rank, world = self.info.rank, self.info.world_size
        commit, self.commit = self.commit, None
        self.epoch_rows = 0
        if commit is None:
            self.epoch_runs = own_runs(self.spec.data.rows("train"), world)[rank]
            self.resharded, self.sources = False, None
            return self.steps, 0, self.steps_per_epoch
        sums.resume(*commits.resumed_sums(commit, rank, world))
        saved = commit["ranks"]
        self.sources = commit["sources"] or {
            (len(saved), r): s["held"] for r, s in enumerate(saved)
        }
        if commit["world_size"] == world and not commit["resharded"]:
            commits.set_rng_state(saved[rank]["rng"])
            self.epoch_runs = [tuple(r) for r in saved[rank]["runs"]]
            self.epoch_rows = saved[rank]["consumed"]
            self.resharded = False
            return self.steps, commit["step"], self.steps_per_epoch - commit["step"]
        self.resharded = True
        stream, steps, self.epoch_runs = commits.resharded_epoch(
            commit, self.spec, rank, world, self.device, epoch, self.sources
        )
        return stream, 0, steps

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
        drawn = itertools.islice(source, count)
        assemble = functools.partial(self._assemble, epoch=epoch)
        if self.streaming:  # the next batches are made in a thread while this one trains
            steps = Prefetched(drawn, assemble, self.device, lambda made: made[0].tensors())
        else:
            steps = map(assemble, drawn)
        try:
            data, compute = self._run_steps(epoch, sums, steps, first, first + count)
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

    def _assemble(self, drawn: tuple, epoch: int) -> tuple:
        """A drawn (chunk, weight, last) of ``epoch`` with its batch made: decoded and on
        the device (in the loader's thread when streaming); a chunk a transformation_fn
        will change is left as it is."""
        chunk, weight, last = drawn
        if self.transform is not None:
            return drawn
        return Batch(chunk, self.spec, self.device, None, self.data.decoder, epoch), weight, last

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
            batch, weight, last = drawn
            if not isinstance(batch, Batch):  # with a transformation_fn
                decoder = self.data.decoder
                batch = Batch(batch, self.spec, self.device, self.transform, decoder, epoch)
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
        with torch.no_grad(), self.stepper.autocast():
            for chunk in chunks:
                batch = Batch(chunk, self.spec, self.device, self.transform, self.data.decoder)
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
        with more processes (elastic growth, ``driver/elastic.py``), and the next epoch's
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
        decision = 2.0 if pause else 1.0 if requested else 0.0
        flag = torch.tensor([decision, float(every)], device=self.device)
        dist.broadcast(flag, src=0)
        decision, every = flag.tolist()
        return decision == 1.0, decision == 2.0, int(every)

    def _commit(self, epoch: int, step: int, sums: EpochSums) -> None:
        """Commit the training state after ``step`` of ``epoch`` (commits.py)."""
        began = time.perf_counter()
        values, first_bad = sums.partial()
        mine = {
            "rng": commits.rng_state(),
            "sums": values,
            "first_bad": first_bad,
            "runs": [tuple(run) for run in self.epoch_runs],
            "consumed": self.epoch_rows,
            "held": isinstance(self.data.train, DeviceShard),
        }
        shards = self._save_shards("commit") if self.sharded else None
        shared = {}
        if self.info.rank == 0:
            shared = {
                **self._state(False, shards),
                "epoch": epoch,
                "step": step,
                "resharded": self.resharded,
                "sources": self.sources,
            }
        if self.tensorboard is not None:  # the step points up to here, kept by a resume
            self.tensorboard.flush()
        commits.write(self.spec.store, self.commit_path, self.info.rank, shared, mine)
        if shards is not None and self.info.rank == 0:  # the commit it replaced
            self._remove_shards("commit-", keep=shards)
        self.commit_s.append(time.perf_counter() - began)
        self.commits_made += 1
        self.commit_seconds += self.commit_s[-1]

    def _state(self, stop: bool, shards: str | None = None) -> dict:
        """What an epoch's checkpoint and a commit both hold; a sharded model's and its
        optimizer's state is in the folder of ``shards`` (``_save_shards``)."""
        if shards is None:
            weights = {
                "model": self.objects.model.state_dict(),
                "optimizer": self.objects.optimizer.state_dict(),
            }
        else:
            weights = {SHARDS: shards}
        return {
            **weights,
            "history": self.state.history,
            "callbacks": callback_states(self.objects.callbacks),
            "output_shapes": self.output_shapes,
            "batches_drawn": self.batches_drawn,
            "world_size": self.info.world_size,
            "base_lrs": self.objects.base_lrs,  # the rates trained at, before lr_scaling
            "stop_training": stop,
            **self.stepper.state_dict(),
        }

    def _write_checkpoint(self, epoch: int, stop: bool) -> None:
        """Rank 0 writes the epoch's checkpoint; with FSDP every rank its shard first."""
        shards = None
        if self.sharded:
            from . import sharded

            shards = f"epoch-{epoch:04d}"
            sharded.save(
                self.spec.store,
                self.checkpoints.shards(epoch),
                self.objects.model,
                self.objects.optimizer,
            )
        if self.info.rank != 0:
            return
        best_epoch = self.best.best_epoch if self.best else None
        state = self._state(stop, shards)
        self.checkpoints.write(epoch, state, {best_epoch} if best_epoch else set())

    def _save_shards(self, prefix: str) -> str:
        """Every rank's shard of model and optimizer in a new folder (a collective); its
        name, ``<prefix>-<id>``, is rank 0's."""
        name = [f"{prefix}-{uuid.uuid4().hex[:12]}" if self.info.rank == 0 else None]
        dist.broadcast_object_list(name, src=0)
        store = self.spec.store
        folder = store.run(self.spec.run_id).shards(name[0])
        from . import sharded

        sharded.save(store, folder, self.objects.model, self.objects.optimizer)
        return name[0]

    def _remove_shards(self, prefix: str, keep: str) -> None:
        """Remove the shard folders named ``<prefix>...`` but ``keep``."""
        store = self.spec.store
        parent = posixpath.dirname(store.run(self.spec.run_id).shards(keep))
        for path in store.fs.ls(parent, detail=False):
            name = posixpath.basename(path.rstrip("/"))
            if name.startswith(prefix) and name != keep:
                store.remove(path)

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

    # -- the end --------------------------------------------------------------------------
    def finish(self) -> RankSummary:
        """Rank 0 writes the result; every rank returns its summary."""
        model = self.objects.model
        selection = self.best.selection() if self.best else None
        elements = sum(p.numel() for p in model.parameters())
        if self.sharded:
            from ..comm import fsdp

            elements = fsdp.local_elements(model)
            if selection:  # every rank's shard of the best epoch
                model.load_state_dict(self.best.best_state)
            weights = fsdp.full_state_dict(model)  # on rank 0; gathered by every rank
            digest = [state_dict_digest(weights) if self.info.rank == 0 else None]
            dist.broadcast_object_list(digest, src=0)
            best = weights
        else:
            weights = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
            digest = [state_dict_digest(weights)]
            best = self.best.best_state if selection else weights
        if self.info.rank == 0 and not self.paused:
            result = {
                "model": best,
                "history": self.state.history,
                "output_shapes": self.output_shapes,
                "summary": self._training_summary(selection),
            }
            store = self.spec.store
            store.write_bytes(store.run(self.spec.run_id).result, state_to_bytes(result))
        # process_group's closing barrier keeps every rank until rank 0 has written it
        return rank_summary(
            self.info,
            self.data,
            self.hook,
            digest[0],
            elements,
            self.batches_run,
            self.optimizer_steps_run,
            self.started,
            compile_backend(self.spec.loop.compile),
            self.paused,
        )

    def _training_summary(self, selection: dict | None) -> dict:
        loop, history = self.spec.loop, self.state.history
        stopped_by = [
            cb.stopped_epoch
            for cb in self.objects.callbacks
            if isinstance(cb, EarlyStopping) and cb.stopped_epoch
        ]
        return {
            **training_summary(
                self.info.world_size,
                self.spec.epochs,
                history,
                self.start_epoch,
                stopped_by[0] if stopped_by else None,
                selection,
                self.checkpoints.epochs(),
            ),
            "resumed_from_commit": self.resumed_commit,
            "commits": self.commits_made,
            "commit_seconds": round(self.commit_seconds, 4),
            "lr_scaling": loop.lr_scaling,
            "base_learning_rates": self.objects.base_lrs,
            "learning_rates": self.start_lrs,
            "backward_passes_per_step": loop.backward_passes_per_step,
            "gradient_compression": loop.gradient_compression,
            "gradient_reduction": loop.gradient_reduction,
            "mixed_precision": loop.mixed_precision,
            "parallelism": loop.parallelism,
            "seconds_per_rank": seconds_per_rank(history),
        }
