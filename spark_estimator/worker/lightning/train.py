"""Executor: one rank of a LightningEstimator fit, a Lightning Trainer on our process group.

Each rank unpickles the LightningModule, its callbacks and ``trainer_args``, and runs
``Trainer.fit`` with DDP over the process group the task already joined (see
``lightning_parts``): one device per task, ``max_epochs = epochs``; what the module logs
per epoch is reduced over all ranks' rows (``ExactResults``). The data comes from
our loader (``RankData``): each epoch is ``train_steps_per_epoch`` batches (default one
exact pass) of an endless, seeded stream over the rank's shard, every rank the same number
of batches. A batch is a dict column name -> tensor (features shaped by ``input_shapes``,
labels, on the device).

After every epoch rank 0 writes Lightning's full checkpoint to the run's checkpoints in the
store, and a fit that finds one resumes from the newest (``ckpt_path``): model, optimizers,
schedulers, loops, callbacks (EarlyStopping, ModelCheckpoint) and our history and data
position. At the end rank 0 writes the result: the final weights, or those of the best
checkpoint of a ModelCheckpoint that monitors a value; every rank returns its
``RankSummary``, with the batches and optimizer steps its Trainer ran per epoch.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import logging
import time
import warnings
from collections.abc import Callable, Iterator

import torch

from ...shared.packages import lightning_package
from ...shared.serialization import loads, state_dict_digest, state_to_bytes
from ...shared.spec import TrainSpec
from ...shared.summary import RankSummary, training_summary
from ...store import Store
from ..comm.ddp import open_shared_memory
from ..comm.ranks import RankInfo
from ..data.batch import Batch
from ..data.rank_data import RankData, rank_summary
from ..loop.loss import as_outputs
from ..loop.resume import agree_on_checkpoint
from .hooks import fsspec_defaults, lightning_parts, url

# Trainer arguments whose defaults differ from Lightning's; trainer_args may set them. The
# driver shows progress, so no bar; our driver checks replace the sanity-check validation.
# The logger (default_logger) writes in the run's folder of the store.
DEFAULTS = {
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}


class _Batches:
    """Batches for Lightning: ``steps`` dicts per iteration; ``draw()`` gives the
    (chunk, epoch) pairs (epoch None in validation), ``decode`` decodes them ahead
    (``Decoder.ahead``; None without variable columns), ``to_dict(chunk, epoch, decoded)``
    makes the module's batch."""

    def __init__(self, steps: int, draw: Callable, to_dict: Callable, decode: Callable | None):
        self.steps, self.draw, self.to_dict, self.decode = steps, draw, to_dict, decode

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        drawn = itertools.islice(self.draw(), self.steps)
        if self.decode is None:
            for chunk, epoch in drawn:
                yield self.to_dict(chunk, epoch, None)
            return
        for (chunk, epoch), decoded in self.decode(drawn):
            yield self.to_dict(chunk, epoch, decoded)


# Lightning's loggers that print to the console themselves (handlers of their own, not
# propagating), besides the rank's logging that the driver shows (RankLog)
LIGHTNING_LOGGERS = (
    "lightning",
    "lightning.pytorch",
    "lightning.fabric",
    "pytorch_lightning",
    "lightning_fabric",
)


@contextlib.contextmanager
def lightning_console_once() -> Iterator[None]:
    """While the block runs, Lightning's loggers print nothing themselves and hand their
    records to the root logger, whose handler is the rank's log: each line of Lightning's
    reaches the driver once (``[rank r] INFO lightning.pytorch...: ...``), not again as
    its own console copy (``INFO: ...``, raw in the executor's stderr). Restored after:
    Python workers are reused."""
    saved = []
    for name in LIGHTNING_LOGGERS:
        if name not in logging.root.manager.loggerDict:  # not imported: nothing to undo
            continue
        log = logging.getLogger(name)
        consoles = [
            h
            for h in log.handlers
            if type(h) is logging.StreamHandler  # a file handler of the user's stays
        ]
        saved.append((log, consoles, log.propagate))
        for handler in consoles:
            log.removeHandler(handler)
        log.propagate = True
    try:
        yield
    finally:
        for log, consoles, propagate in saved:
            for handler in consoles:
                log.addHandler(handler)
            log.propagate = propagate


# the modules of Lightning's own warnings (warnings.filterwarnings' module pattern)
LIGHTNING_MODULES = r"(lightning|pytorch_lightning|lightning_fabric|lightning_utilities)(\.|$)"


@contextlib.contextmanager
def lightning_warnings_once(rank: int) -> Iterator[None]:
    """Lightning's warnings (deprecations, its tips) from rank 0 only, as Lightning means
    them: its ``rank_zero_*`` helpers told this task's rank (a reused Python worker keeps
    the rank of the task that first imported Lightning), and on the other ranks the
    ``warnings`` raised in Lightning's own code (the same on every rank) ignored. Restored
    after: Python workers are reused."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    before = getattr(rank_zero_only, "rank", None)
    rank_zero_only.rank = rank
    try:
        with warnings.catch_warnings():
            if rank != 0:
                warnings.filterwarnings("ignore", module=LIGHTNING_MODULES)
            yield
    finally:
        if before is not None:
            rank_zero_only.rank = before


def train_lightning(
    spec: TrainSpec, info: RankInfo, report: Callable[..., None] | None
) -> RankSummary:
    """Train this rank; return its summary (rank 0 also writes the result to the store)."""
    with lightning_warnings_once(info.rank):
        objects = loads(spec.bundle)  # imports Lightning: its loggers exist from here
        with lightning_console_once():
            return _train(spec, info, report, objects)


def _train(
    spec: TrainSpec, info: RankInfo, report: Callable[..., None] | None, objects: dict
) -> RankSummary:
    module = objects["model"]
    pl = lightning_package(module)
    _, _, EpochRecorder, SharedMemoryGradients, _ = lightning_parts(pl)
    rank, world, device = info.rank, info.world_size, info.device
    store, run_id = spec.store, spec.run_id
    recorder = EpochRecorder(
        store,
        run_id,
        spec.seed,
        spec.keep_checkpoints,
        report if rank == 0 else None,
        objects["terminate_on_nan"],
    )
    checkpoints = recorder.checkpoints

    transform = loads(spec.loader.transformation_fn) if spec.loader.transformation_fn else None

    names = [c.name for c in spec.data.features + spec.data.labels]
    # lockstep: every rank runs as many validation batches (Lightning may sync what is logged)
    data = RankData(spec, info, lockstep=True)

    def to_dict(chunk, epoch: int | None, decoded) -> dict:
        """A batch as the module gets it; ``epoch`` (training only) seeds augmentation,
        ``decoded``: its variable columns, decoded ahead."""
        batch = Batch(chunk, spec, device, transform, data.decoder, epoch, decoded)
        if recorder.output_shapes is None and recorder.first_inputs is None:
            recorder.first_inputs = [
                t[:1].detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else t[:1]
                for t in batch.inputs
            ]
        masks = {f"{name}_mask": mask for name, mask in batch.masks.items()}
        return {**dict(zip(names, batch.features + batch.labels)), **masks}

    started = time.time()
    recorder.steps_per_epoch = data.steps_per_epoch
    stream = None

    def draw_training():
        nonlocal stream
        if stream is None:  # after Lightning restored the recorder: start where it was
            stream = data.training_steps(1, recorder.batches_drawn)
        for chunk, _weight, _last in stream:
            recorder.batches_drawn += 1
            yield chunk, (recorder.batches_drawn - 1) // data.steps_per_epoch + 1

    decode = None
    if data.decoder is not None:
        decoder = data.decoder

        def decode(drawn):  # each (chunk, epoch) of a pass, decoded ahead
            return decoder.ahead(drawn, lambda d: d[1], lambda d: d[0])

    train_data = _Batches(data.steps_per_epoch, draw_training, to_dict, decode)
    val_data = None
    if data.has_validation:
        sizes = data.validation_sizes  # in order, so every pass is the same (pass index 1)

        def draw_validation():
            return ((chunk, None) for chunk in data.validation.batches(sizes, 1))

        val_data = _Batches(len(sizes), draw_validation, to_dict, decode)

    resume_epoch = agree_on_checkpoint(checkpoints, rank, device)
    callbacks = list(objects.get("callbacks") or [])
    shared = open_shared_memory(info, spec.collective_timeout)
    if shared is not None:
        callbacks.append(SharedMemoryGradients(shared))
    trainer = task_trainer(
        pl,
        info,
        store,
        run_id,
        spec.epochs,
        [*callbacks, recorder],
        objects.get("trainer_args") or {},
    )
    ckpt_path = url(store, checkpoints.path(resume_epoch)) if resume_epoch else None
    try:
        with fsspec_defaults(store):
            trainer.fit(module, train_data, val_data, ckpt_path=ckpt_path)
    finally:
        if stream is not None:
            stream.close()
        data.close()
    module = module.cpu()
    weights = {k: v.detach().to("cpu") for k, v in module.state_dict().items()}
    if rank == 0:
        if recorder.output_shapes is None and recorder.first_inputs is not None:
            recorder.output_shapes = _output_shapes(module, recorder.first_inputs)
        selection, best = _best_checkpoint(pl, trainer)
        result = {
            "model": best if best is not None else weights,
            "history": recorder.history,
            "output_shapes": recorder.output_shapes,
            "summary": _summary(pl, trainer, recorder, world, resume_epoch, selection),
        }
        store.write_bytes(store.run(run_id).result, state_to_bytes(result))
    return rank_summary(
        info,
        data,
        shared,
        state_dict_digest(weights),
        sum(p.numel() for p in module.parameters()),
        recorder.batches_per_epoch,
        recorder.optimizer_steps_per_epoch,
        started,
    )


def task_trainer(
    pl,
    info: RankInfo,
    store: Store,
    run_id: str,
    epochs: int,
    callbacks: list,
    trainer_args: dict,
):
    """The Trainer of this task: DDP over the process group it joined (a node of one device,
    ``TaskEnvironment``), checkpoint files through the store, ``epochs`` epochs,
    ``callbacks`` (our recorder last), ``trainer_args`` over ``DEFAULTS``, and the values
    ``self.log`` receives collected by ``ExactResults`` (epoch means exact over all rows)."""
    TaskEnvironment, StoreCheckpointIO, _, _, ExactResults = lightning_parts(pl)
    device, folder = info.device, url(store, store.run(run_id).lightning)
    args = {**DEFAULTS, **trainer_args}
    args.setdefault("logger", default_logger(pl, folder))
    trainer = pl.Trainer(
        **args,
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=[device.index] if device.type == "cuda" else 1,
        num_nodes=info.world_size,
        strategy=pl.strategies.DDPStrategy(
            cluster_environment=TaskEnvironment(info.rank, info.world_size)
        ),
        plugins=[StoreCheckpointIO(store)],
        max_epochs=epochs,
        callbacks=callbacks,
        enable_checkpointing=True,
        default_root_dir=folder,
        use_distributed_sampler=False,
    )
    ExactResults.install(trainer)
    return trainer


def default_logger(pl, folder: str):
    """The logger of a fit whose trainer_args give none: Lightning's TensorBoardLogger in
    ``folder``'s ``tensorboard/`` (one folder per run: a resumed fit adds event files beside
    the first attempt's), or, without tensorboard or tensorboardX installed, its CSVLogger
    in ``csv/``, as Lightning's own default falls back. Step-level ``self.log`` values and
    LearningRateMonitor go there."""
    has = [importlib.util.find_spec(name) for name in ("tensorboard", "tensorboardX")]
    if any(has):
        return pl.loggers.TensorBoardLogger(folder, name="tensorboard", version="")
    return pl.loggers.CSVLogger(folder, name="csv", version="")


def _output_shapes(module, inputs: list[torch.Tensor]) -> list[list[int]]:
    """The shapes of forward()'s outputs for one row, without the batch dimension."""
    was_training = module.training
    module.eval()
    with torch.no_grad():
        outputs = as_outputs(module(*inputs))
    module.train(was_training)
    return [list(o.shape[1:]) for o in outputs]


def _best_checkpoint(pl, trainer) -> tuple[dict | None, dict | None]:
    """(selection, weights) of the first ModelCheckpoint that monitors a value and saved a
    best checkpoint; (None, None) without one."""
    for cb in trainer.callbacks:
        if isinstance(cb, pl.callbacks.ModelCheckpoint) and cb.monitor and cb.best_model_path:
            saved = trainer.strategy.checkpoint_io.load_checkpoint(cb.best_model_path)
            score = cb.best_model_score
            selection = {
                "epoch": int(saved["epoch"]) + 1,
                "monitor": cb.monitor,
                "value": float(score) if score is not None else None,
                "path": cb.best_model_path,
            }
            return selection, saved["state_dict"]
    return None, None


def _summary(pl, trainer, recorder, world: int, resume_epoch: int, selection) -> dict:
    stopped_by = [
        cb.stopped_epoch + 1
        for cb in trainer.callbacks
        if isinstance(cb, pl.callbacks.EarlyStopping) and cb.stopped_epoch
    ]
    return {
        **training_summary(
            world,
            trainer.max_epochs,
            recorder.history,
            resume_epoch,
            stopped_by[0] if stopped_by else None,
            selection,
            recorder.checkpoints.epochs(),
        ),
        "trainer": "lightning",
        "lightning_version": pl.__version__,
        "precision": str(trainer.precision),
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
    }
