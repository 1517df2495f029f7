"""Driver: checks of LightningEstimator's training inputs (module, callbacks, trainer_args).

Like ``validate_training``: errors name the parameter at fault, before any Spark job.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Iterator

from ..shared.packages import PACKAGES, lightning_package
from ..shared.serialization import dumps

# Trainer arguments the estimator sets itself, and the param to use instead
RESERVED = {
    "accelerator": "use_gpu",
    "devices": "num_proc and use_gpu",
    "num_nodes": "num_proc",
    "strategy": "num_proc (DDP over the barrier tasks)",
    "max_epochs": "epochs",
    "max_steps": "epochs and train_steps_per_epoch",
    "limit_train_batches": "train_steps_per_epoch",
    "limit_val_batches": "validation_steps_per_epoch",
    "callbacks": "callbacks",
    "plugins": "store (checkpoints go through it)",
    "default_root_dir": "store and run_id",
    "enable_checkpointing": "callbacks (a ModelCheckpoint)",
    "use_distributed_sampler": "the estimator's data path (each rank reads its own shard)",
    "fast_dev_run": "epochs, train_steps_per_epoch and validation_steps_per_epoch",
    "overfit_batches": "train_steps_per_epoch",
    "reload_dataloaders_every_n_epochs": "the estimator's data path",
}


def check_module(model):
    """The Lightning package of ``model``; ImportError without Lightning, TypeError when
    ``model`` is not a LightningModule."""
    pl = lightning_package(model)
    if pl is None:
        raise TypeError(
            f"model: expected a LightningModule ({' or '.join(PACKAGES)}), got "
            f"{type(model).__name__}; for a plain torch.nn.Module use TorchEstimator"
        )
    return pl


def check_callbacks(pl, callbacks) -> None:
    if callbacks is None:
        return
    if not isinstance(callbacks, (list, tuple)):
        raise TypeError(
            f"callbacks: expected a list of Lightning callbacks, got {type(callbacks).__name__}"
        )
    for cb in callbacks:
        if not isinstance(cb, pl.Callback):
            raise TypeError(
                f"callbacks: {cb!r} is not a {pl.__name__}.Callback (the package of the "
                "model); spark_estimator.callbacks are for TorchEstimator"
            )


# where a module logs what Lightning's callbacks monitor: the hooks of each loop
VALIDATION_HOOKS = ("validation_step", "on_validation_batch_end", "on_validation_epoch_end")
TRAINING_HOOKS = ("training_step", "on_train_batch_end", "on_train_epoch_end")


def check_monitors(model, callbacks, has_validation: bool) -> None:
    """Without validation data, a callback may not monitor a value the module logs only in
    its validation hooks: Lightning never runs them, and the callback would fail on every
    executor. A value counts as logged there when its name is a string constant in the code
    of those hooks (of the module's class or its parents) and not in the training hooks'; a
    name made at run time (an f-string) is not seen, and is left to Lightning."""
    if has_validation or not callbacks:
        return
    monitored = [cb for cb in callbacks if isinstance(getattr(cb, "monitor", None), str)]
    if not monitored:
        return
    validation_only = validation_names(model)
    for cb in monitored:
        if cb.monitor in validation_only:
            raise ValueError(
                f"callbacks: {type(cb).__name__} monitors '{cb.monitor}', which "
                f"{type(model).__name__} logs in its validation hooks, but this fit has no "
                "validation data; set validation= (a fraction or a column) or monitor a "
                "value logged in training"
            )


def validation_names(model) -> set[str]:
    """The names ``model`` logs in its validation hooks only, as ``check_monitors`` reads
    them (string constants of the hooks' code)."""
    return _strings(model, VALIDATION_HOOKS) - _strings(model, TRAINING_HOOKS)


def _strings(model, hooks: tuple[str, ...]) -> set[str]:
    """The string constants of ``hooks`` as the module's own classes define them (not
    Lightning's defaults), read from their code objects, not their source: a module
    defined in ``__main__`` or a notebook has methods without readable source once a fit
    has unpickled it in the same process (cloudpickle's by-value classes)."""
    found: set[str] = set()
    for cls in type(model).__mro__:
        if cls.__module__.split(".")[0] in ("lightning", "pytorch_lightning", "torch"):
            continue
        for hook in hooks:
            code = getattr(vars(cls).get(hook), "__code__", None)
            if code is not None:
                found.update(_code_strings(code))
    return found


def _code_strings(code: types.CodeType) -> Iterator[str]:
    """The string constants of ``code`` and of the code it nests (comprehensions, lambdas)."""
    for const in code.co_consts:
        if isinstance(const, str):
            yield const
        elif isinstance(const, types.CodeType):
            yield from _code_strings(const)


def check_trainer_args(pl, trainer_args) -> dict:
    """``trainer_args`` as a dict of Trainer arguments the estimator does not set."""
    if trainer_args is None:
        return {}
    if not isinstance(trainer_args, dict):
        raise TypeError(f"trainer_args: expected a dict, got {type(trainer_args).__name__}")
    accepted = inspect.signature(pl.Trainer.__init__).parameters
    for name in trainer_args:
        if name in RESERVED:
            raise ValueError(
                f"trainer_args: '{name}' is set by the estimator; use {RESERVED[name]} instead"
            )
        if name not in accepted:
            raise ValueError(f"trainer_args: '{name}' is not an argument of {pl.__name__}.Trainer")
    return dict(trainer_args)


def with_profiler(pl, trainer_args: dict, profiler) -> dict:
    """``trainer_args`` with the ``profiler`` param as the Trainer's profiler (Horovod's
    estimator argument), given once, as a name or a lightning Profiler."""
    if profiler is None:
        return trainer_args
    if "profiler" in trainer_args:
        raise ValueError(
            "profiler: set both as the profiler param and in trainer_args; give it once"
        )
    if not isinstance(profiler, (str, pl.profilers.Profiler)):
        raise TypeError(
            "profiler: expected 'simple', 'advanced', 'pytorch' or a "
            f"{pl.__name__}.profilers.Profiler, got {type(profiler).__name__}"
        )
    return {**trainer_args, "profiler": profiler}


def lightning_bundle(model, callbacks, trainer_args: dict, terminate_on_nan: bool) -> bytes:
    """The one cloudpickle of what the executors train with; each part is pickled on its
    own first, so a failure names its parameter."""
    objects = {"model": model, "callbacks": callbacks, "trainer_args": trainer_args}
    for name, value in objects.items():
        dumps(value, name)
    return dumps({**objects, "terminate_on_nan": terminate_on_nan}, "model")
