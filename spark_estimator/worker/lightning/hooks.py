"""Executor: the pieces that put a Lightning Trainer on a barrier task.

``lightning_parts`` builds our plug-ins on the base classes of the Lightning package a module
was written against (``lightning_package`` finds it):

- ``TaskEnvironment``: a ClusterEnvironment that tells Lightning the task's rank and world
  size. Every task counts as a node of one device (node_rank = rank), so a job whose tasks
  share a host or not looks the same. The process group is already formed by
  ``rendezvous.process_group``, and Lightning's DDP strategy then uses it as it is.
- ``StoreCheckpointIO``: Lightning's checkpoint files (ours and a ModelCheckpoint's) are
  written atomically through the store's filesystem, with its storage options.
- ``ExactResults``: Lightning's collection of the values ``self.log`` receives, whose
  epoch means are exact over all ranks' rows (``exact_epoch_means``), so what Lightning's
  callbacks monitor is the history's value.
- ``EpochRecorder``: a Checkpoint callback that runs after the user's callbacks at each
  epoch end. It seeds the epoch (``resume.seed_epoch``), reports progress, writes the
  epoch's record into the history (the training_step losses and everything logged per
  epoch, as Lightning computed it, over ranks by ``over_ranks``), counts the epoch's
  batches drawn and optimizer steps, writes the epoch's checkpoint to the store, and
  carries the run's own state (history, data position) inside Lightning's checkpoint.
- ``SharedMemoryGradients``: a callback that gives the DDP model the shared-memory
  gradient allreduce (``shared_memory_allreduce``) when every rank is a CPU process on one
  host. Lightning's own ``ddp_comm_hook`` option registers hooks on CUDA only.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import time
from collections.abc import Callable, Iterator

import fsspec
import torch
import torch.distributed as dist

from ...shared.serialization import state_from_bytes, state_to_bytes
from ...store import Store
from ..comm.ddp import shared_memory_allreduce
from ..loop.checkpoints import Checkpoints
from ..loop.metrics import non_finite_loss_error
from ..loop.resume import seed_epoch
from ..observe.run_log import FLUSH_S
from ..observe.tensorboard import TensorBoardLog


def url(store: Store, path: str) -> str:
    """``path`` of the store as a URL Lightning's own fsspec calls resolve the same way."""
    return path if store.protocol == "file" else store.fs.unstrip_protocol(path)


@contextlib.contextmanager
def fsspec_defaults(store: Store) -> Iterator[None]:
    """Make the store's storage options fsspec's defaults for its protocol while the block
    runs, so Lightning's own filesystem calls (a ModelCheckpoint listing its folder) reach a
    remote store with its credentials; restored afterwards (Python workers are reused)."""
    if store.protocol == "file" or not store.storage_options:
        yield
        return
    conf = fsspec.config.conf
    saved = conf.get(store.protocol)
    conf[store.protocol] = {**(saved or {}), **store.storage_options}
    try:
        yield
    finally:
        if saved is None:
            conf.pop(store.protocol, None)
        else:
            conf[store.protocol] = saved


def _file_store(store: Store, path: str) -> Store:
    """The store that holds ``path``: ours, or (another filesystem) that filesystem's root."""
    protocol = fsspec.core.split_protocol(str(path))[0] or "file"
    if protocol in ("file", "local") and store.protocol == "file" or protocol == store.protocol:
        return store
    return Store(f"{protocol}://" if protocol != "file" else "/")


def epoch_metrics(trainer) -> dict[str, float]:
    """The values logged for the epoch in the loop that just ran (training or validation),
    as floats; a value logged with on_step and on_epoch appears once, by its own name."""
    results = getattr(trainer, "_results", None)
    values = results.metrics(False)["callback"] if results is not None else {}
    out = {}
    for name, value in values.items():
        if name.endswith("_epoch") and name[: -len("_epoch")] in values:
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            out[name] = float(value.item())
        elif isinstance(value, (int, float)):
            out[name] = float(value)
    return out


def over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Each name's value over the ranks that logged it (one collective): the value where
    they all hold the same (one reduced over ranks: an exact mean, a synced sum), else
    their mean (a sum, max or min each rank computed alone)."""
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, values)
    names = sorted({name for rank_values in gathered for name in rank_values})
    out = {}
    for name in names:
        held = [v[name] for v in gathered if name in v]
        same = all(value == held[0] for value in held)
        out[name] = held[0] if same else sum(held) / len(held)
    return out


def _exact_mean_candidate(metric) -> bool:
    """A mean-reduced tensor value logged for the epoch by every rank (not rank_zero_only)
    and reduced over the whole group, not yet computed this epoch."""
    meta = metric.meta
    sync = meta.sync
    return (
        metric.is_tensor
        and meta.on_epoch
        and meta.is_mean_reduction
        and metric._computed is None
        and not sync.rank_zero_only
        and not (sync.should and sync.group is not None)
    )


def exact_epoch_means(results) -> None:
    """Compute the epoch value of every mean-reduced value in Lightning's collection
    ``results`` (a ``_ResultCollection``) that is not yet computed, as its exact mean over
    all ranks' rows: the ranks' sums of value x batch size over their sums of batch sizes
    (one collective). Lightning's own reduction of such a value is not: with ``sync_dist``
    it averages the ranks' integer row counts (25 rows on 2 ranks count as 12 on gloo);
    without, each rank keeps the mean of its own rows.

    Each value's result is set as the metric's computed value, which Lightning then reads
    (its ``trainer.callback_metrics``, what ModelCheckpoint and EarlyStopping monitor, its
    loggers) in place of its own reduction; every rank gets the same. Sums, max and min,
    ``torchmetrics.Metric`` values, values logged with ``rank_zero_only`` or a
    ``sync_dist_group`` are left to Lightning. Called where Lightning computes epoch values
    (on their first read after the epoch's last ``self.log``), which every rank does at
    the same hooks, as for ``sync_dist``."""
    pending = {key: m for key, m in results.valid_items() if _exact_mean_candidate(m)}
    if not pending:
        return
    sums = torch.stack(
        [torch.stack([m.value.double(), m.cumulated_batch_size.double()]) for m in pending.values()]
    )
    local = dict(zip(pending, sums.cpu().tolist()))
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, local)
    for key, metric in pending.items():
        parts = [rank_sums[key] for rank_sums in gathered if key in rank_sums]
        total, rows = sum(p[0] for p in parts), sum(p[1] for p in parts)  # in rank order
        mean = total / rows if rows else math.nan
        metric._computed = torch.tensor(mean, dtype=metric.value.dtype, device=metric.value.device)


@functools.cache
def lightning_parts(pl):
    """Our plug-in classes built on package ``pl`` (lightning.pytorch or pytorch_lightning),
    once per package."""
    result = importlib.import_module(f"{pl.__name__}.trainer.connectors.logger_connector.result")

    class ExactResults(result._ResultCollection):
        """The values ``self.log`` received in one loop (training or validation), their
        epoch means exact over all ranks' rows (``exact_epoch_means``)."""

        def metrics(self, on_step: bool):
            if not on_step:
                exact_epoch_means(self)
            return super().metrics(on_step)

        @staticmethod
        def install(trainer) -> None:
            """Make the collections of ``trainer``'s fit (its training and validation loops)
            ours, before it runs."""
            epoch_loop = trainer.fit_loop.epoch_loop
            epoch_loop._results = ExactResults(training=True)
            epoch_loop.val_loop._results = ExactResults(training=False)

    class TaskEnvironment(pl.plugins.ClusterEnvironment):
        def __init__(self, rank: int, world_size: int):
            super().__init__()
            self._rank, self._world_size = rank, world_size

        @property
        def creates_processes_externally(self) -> bool:
            return True  # Spark started them

        @property
        def main_address(self) -> str:
            return "127.0.0.1"  # unused: the process group exists before the Trainer

        @property
        def main_port(self) -> int:
            return 0

        @staticmethod
        def detect() -> bool:
            return False

        def world_size(self) -> int:
            return self._world_size

        def set_world_size(self, size: int) -> None:
            self._world_size = size

        def global_rank(self) -> int:
            return self._rank

        def set_global_rank(self, rank: int) -> None:
            self._rank = rank

        def local_rank(self) -> int:
            return 0

        def node_rank(self) -> int:
            return self._rank

    class StoreCheckpointIO(pl.plugins.CheckpointIO):
        def __init__(self, store: Store):
            super().__init__()
            self.store = store

        def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
            _file_store(self.store, path).write_bytes(str(path), state_to_bytes(checkpoint))

        def load_checkpoint(self, path, map_location=None, weights_only=None):
            data = _file_store(self.store, path).read_bytes(str(path))
            return state_from_bytes(data, weights_only=weights_only is not False)

        def remove_checkpoint(self, path) -> None:
            _file_store(self.store, path).remove(str(path))

    class EpochRecorder(pl.callbacks.Checkpoint):
        """Our per-epoch record and checkpoint; the run's state travels in Lightning's
        checkpoint (``state_dict``), so a resumed Trainer restores it with the rest."""

        def __init__(
            self,
            store: Store,
            run_id: str,
            seed: int,
            keep: int | None,
            report,
            terminate_on_nan: bool = True,
        ):
            self.store, self.run_id, self.seed = store, run_id, seed
            self.terminate_on_nan = terminate_on_nan
            self.checkpoints = Checkpoints(store, run_id, keep)
            self.report: Callable[..., None] | None = report
            self.reported = 0.0
            self.history: list[dict] = []
            self.batches_drawn = 0
            self.output_shapes: list[list[int]] | None = None
            self.stopped = False
            self.first_inputs: list[torch.Tensor] | None = None  # for the output shapes
            self.loss_sum: torch.Tensor | float = 0.0  # sum of loss x rows (on the device)
            self.rows = 0
            # this epoch's training losses that were not finite: count, first step (device)
            self.bad_steps: torch.Tensor | int = 0
            self.first_bad: torch.Tensor | None = None
            self.validation: dict[str, float] = {}
            self.lrs: list[float] = []
            self.epochs = 0
            self.steps_per_epoch = 0
            self.tensorboard = None
            # per epoch of this attempt: batches drawn from the training stream, and optimizer
            # steps (trainer.global_step's growth: each optimizer's steps, counted by Lightning)
            self.batches_per_epoch: list[int] = []
            self.optimizer_steps_per_epoch: list[int] = []
            self.counted = (0, 0)  # (batches_drawn, global_step) at the last epoch's end

        @property
        def state_key(self) -> str:
            return "spark_estimator"

        def state_dict(self) -> dict:
            return {
                "history": self.history,
                "batches_drawn": self.batches_drawn,
                "world_size": dist.get_world_size(),
                "output_shapes": self.output_shapes,
                "stopped": self.stopped,
            }

        def load_state_dict(self, state: dict) -> None:
            self.history = list(state["history"])
            self.batches_drawn = state["batches_drawn"]
            if state.get("world_size", dist.get_world_size()) != dist.get_world_size():
                # an elastic fit started again resized: the stream of passes goes on as if
                # this size had trained from the start (as our own loop's resume does)
                self.batches_drawn = len(self.history) * self.steps_per_epoch
            self.output_shapes = state["output_shapes"]
            self.stopped = state["stopped"]

        def on_train_start(self, trainer, pl_module) -> None:  # after a resume's restore
            self.epochs = trainer.max_epochs
            self.counted = (self.batches_drawn, trainer.global_step)
            if trainer.is_global_zero:
                self.tensorboard = TensorBoardLog(self.store, self.run_id)
            if self.stopped:  # resumed from the checkpoint of the epoch that stopped it
                trainer.should_stop = True

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            seed_epoch(self.seed, trainer.current_epoch + 1, trainer.global_rank)
            self.loss_sum, self.rows = 0.0, 0
            self.bad_steps, self.first_bad = 0, None
            self.validation = {}
            self.lrs = [g["lr"] for opt in trainer.optimizers for g in opt.param_groups]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            rows = _batch_rows(batch)
            if isinstance(loss, torch.Tensor) and rows:
                self.loss_sum = self.loss_sum + loss.detach().double() * rows
                self.rows += rows
                bad = ~torch.isfinite(loss.detach())  # no host sync: read at the epoch end
                self.bad_steps = self.bad_steps + bad.long()
                step = torch.full_like(bad, batch_idx + 1, dtype=torch.long)
                none = torch.full_like(step, torch.iinfo(torch.int64).max)
                first = torch.where(bad, step, none)
                self.first_bad = first if self.first_bad is None else self.first_bad.minimum(first)
            if self.report is not None and time.monotonic() - self.reported >= FLUSH_S:
                self._progress(trainer, batch_idx + 1)

        def on_validation_end(self, trainer, pl_module) -> None:
            if not trainer.sanity_checking:
                self.validation = epoch_metrics(trainer)

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            epoch = trainer.current_epoch + 1
            values = [float(self.loss_sum), self.rows, int(self.bad_steps)]
            sums = torch.tensor(values, dtype=torch.float64, device=pl_module.device)
            dist.all_reduce(sums)
            if self.terminate_on_nan and sums[2]:  # before this epoch's checkpoint
                first = int(self.first_bad) if self.first_bad is not None else None
                raise non_finite_loss_error(
                    epoch,
                    first if first != torch.iinfo(torch.int64).max else None,
                    int(sums[2]),
                    trainer.world_size,
                    trainer.global_rank,
                    pl_module.device,
                    self.checkpoints.last(),
                )
            train = {"loss": float(sums[0] / sums[1]) if sums[1] else None}
            logged = {f"train/{k}": v for k, v in epoch_metrics(trainer).items()}
            logged.update({f"validation/{k}": v for k, v in self.validation.items()})
            record = {
                "epoch": epoch,
                "num_proc": trainer.world_size,
                "lr": self.lrs,
                "train": train,
            }
            for key, value in over_ranks(logged).items():
                split, name = key.split("/", 1)
                record.setdefault(split, {})[name] = value
            self.history.append(record)
            drawn, steps = self.batches_drawn, trainer.global_step
            self.batches_per_epoch.append(drawn - self.counted[0])
            self.optimizer_steps_per_epoch.append(steps - self.counted[1])
            self.counted = (drawn, steps)
            self.stopped = bool(trainer.should_stop)
            # the whole state, to resume from (saying so keeps Lightning from logging it)
            path = url(self.store, self.checkpoints.path(epoch))
            trainer.save_checkpoint(path, weights_only=False)
            if trainer.is_global_zero:
                self.checkpoints.prune()
                self.tensorboard.write(self.history)
                self._progress(trainer, self.steps_per_epoch, at_epoch_end=True)

        def _progress(self, trainer, step: int, at_epoch_end: bool = False) -> None:
            if self.report is None:
                return
            self.reported = time.monotonic()
            last = self.history[-1] if self.history else None
            running = float(self.loss_sum) / self.rows if self.rows else None
            self.report(
                epoch=trainer.current_epoch + 1,
                epochs=self.epochs,
                step=step,
                steps=self.steps_per_epoch,
                loss=last["train"]["loss"] if at_epoch_end else running,
                last=last,
            )

    class SharedMemoryGradients(pl.Callback):
        def __init__(self, shared):
            self.shared = shared

        def on_train_start(self, trainer, pl_module) -> None:  # DDP wraps the module by now
            trainer.strategy.model.register_comm_hook(self.shared, shared_memory_allreduce)

    return TaskEnvironment, StoreCheckpointIO, EpochRecorder, SharedMemoryGradients, ExactResults


def _batch_rows(batch) -> int:
    if isinstance(batch, dict) and batch:
        return len(next(iter(batch.values())))
    return 0
