"""Executor: what an epoch's checkpoint and a commit hold of a rank's training, written
and taken back (``SavedState``, a part of the training loop).

Rank 0 writes the model, optimizer, scheduler and scaler states, the history, the
callbacks' states, the data position and the rates trained at; with FSDP every rank first
writes its shard of model and optimizer (``sharded``), and rank 0's file names their
folder. Taking one back goes on exactly (``resume``): after another number of processes
the rates are rescaled and the stream of passes starts as if this size had trained from the
start; rates other than this fit's are replaced (``objects.take_new_rates``); a finished
run stopped early goes on when trained further (``resume.continue_stopped``).
"""

from __future__ import annotations

import logging
import posixpath
import uuid

import torch.distributed as dist

from .checkpoints import SHARDS
from .objects import rescale_restored, take_new_rates
from .resume import callback_states, continue_stopped, load_checkpoint, restore_callbacks

log = logging.getLogger(__name__)


def _sharded():
    """The FSDP checkpoint module: torch's DCP, imported by sharded fits only (a second)."""
    from . import sharded

    return sharded


class SavedState:
    """The training loop's checkpoints and commits, in and out (a mixin of the loop: its
    ``spec``, ``info``, ``objects``, ``stepper``, ``checkpoints``, ``best``, ``state``)."""

    def _restore(self, saved: dict) -> None:
        """Continue from an epoch's checkpoint (see ``load_checkpoint``) or from a commit inside
        the next epoch (``EpochCommits``), which holds the same keys and the epoch's position."""
        epoch = saved["epoch"]
        objects, store = self.objects, self.spec.store
        if SHARDS in saved:
            folder = store.run(self.spec.run_id).shards(saved[SHARDS])
            _sharded().load(store, folder, objects.model, objects.optimizer)
        else:
            objects.model.load_state_dict(saved["model"])
            objects.optimizer.load_state_dict(saved["optimizer"])
        self.stepper.load_state_dict(saved)
        restore_callbacks(objects.callbacks, saved["callbacks"])
        if self.best is not None and self.best.best_epoch is not None:
            best = self.best.best_epoch
            if SHARDS in saved:  # the best epoch's checkpoint is never pruned
                folder = self.checkpoints.shards(best)
                self.best.best_state = _sharded().model_state(store, folder, objects.model)
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
            shards = f"epoch-{epoch:04d}"
            _sharded().save(
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
        _sharded().save(store, folder, self.objects.model, self.objects.optimizer)
        return name[0]

    def _remove_shards(self, prefix: str, keep: str) -> None:
        """Remove the shard folders named ``<prefix>...`` but ``keep``."""
        store = self.spec.store
        parent = posixpath.dirname(store.run(self.spec.run_id).shards(keep))
        for path in store.fs.ls(parent, detail=False):
            name = posixpath.basename(path.rstrip("/"))
            if name.startswith(prefix) and name != keep:
                store.remove(path)
