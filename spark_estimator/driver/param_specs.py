"""The machinery of the stages' Spark ML Params (driver side): ``ParamSpec``, the one
definition of a param (name, doc, type converter, default); ``SpecParams``, which makes the
``pyspark.ml.param.Param`` of each spec a class declares (``_specs``) and sets the
defaults; the type converters the specs name; and the names of Spark's own params:
snake_case spellings accepted for Spark's (``SPARK_ALIASES``), Spark ML's names of
column params that are refused, naming ours (``SPARK_ML_NAMES``), and any other unknown
keyword refused naming the closest params (``check_keywords``, with other libraries' names
in ``FOREIGN_NAMES``). The params themselves are declared in the ``driver.params`` module.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import numbers
from collections.abc import Callable
from typing import Any, ClassVar

from pyspark.ml.param import Param, Params, TypeConverters


def to_optional_int(value: Any) -> int | None:
    return None if value is None else TypeConverters.toInt(value)


def to_optional_str(value: Any) -> str | None:
    return None if value is None else TypeConverters.toString(value)


def to_optional_list_str(value: Any) -> list[str] | None:
    return None if value is None else TypeConverters.toListString(value)


def to_column_names(value: Any) -> list[str]:
    """A list of column names; one name alone is a one-element list."""
    return [value] if isinstance(value, str) else TypeConverters.toListString(value)


def to_optional_list_float(value: Any) -> list[float] | None:
    return None if value is None else TypeConverters.toListFloat(value)


def to_optional_float(value: Any) -> float | None:
    return None if value is None else TypeConverters.toFloat(value)


def to_input_shapes(value: Any) -> list[list[int]] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(s, (list, tuple)) and all(isinstance(d, int) for d in s) for s in value
    ):
        raise TypeError(f"input_shapes: expected a list of int lists, got {value!r}")
    return [list(s) for s in value]


def to_validation(value: Any) -> float | str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"validation: expected a fraction in (0, 1) or a boolean column name, got {value!r}"
        )
    return float(value)


def to_use_gpu(value: Any) -> bool | str:
    """``"auto"``, True or False (saved estimators hold True or False); also ``run``'s."""
    if isinstance(value, bool) or value == "auto":
        return value
    raise TypeError(f"use_gpu: expected 'auto', True or False, got {value!r}")


def to_class_names(value: Any) -> list[str] | None:
    """``fsdp_wrap``: module classes, or their names, as class names (saved as JSON)."""
    if value is None:
        return None
    items = [value] if isinstance(value, (str, type)) else list(value or [])
    names = []
    for item in items:
        if isinstance(item, type):
            names.append(item.__name__)
        elif isinstance(item, str) and item:
            names.append(item)
        else:
            raise TypeError(f"fsdp_wrap: expected module classes or class names, got {item!r}")
    return names


# the loss names ``loss`` takes: each is the torch.nn module of that name, built with its
# defaults (so the param holds the module); the modules' own names are taken too
LOSS_NAMES = {
    "mse": "MSELoss",
    "l2": "MSELoss",
    "mae": "L1Loss",
    "l1": "L1Loss",
    "cross_entropy": "CrossEntropyLoss",
    "nll": "NLLLoss",
    "bce": "BCELoss",
    "bce_with_logits": "BCEWithLogitsLoss",
    "smooth_l1": "SmoothL1Loss",
    "huber": "HuberLoss",
    "kl_div": "KLDivLoss",
    "poisson_nll": "PoissonNLLLoss",
}


def loss_names() -> str:
    """The names ``loss`` takes, as its messages list them."""
    by_module: dict[str, list[str]] = {}
    for name, module in LOSS_NAMES.items():
        by_module.setdefault(module, []).append(f"'{name}'")
    return ", ".join(" / ".join(names) + f" ({module})" for module, names in by_module.items())


def to_loss(value: Any) -> Any:
    """``loss``: a name of ``LOSS_NAMES`` (or a torch.nn loss module's class name, any
    case, '-' for '_') as that module built with its defaults, in a list too; anything
    else as given (``validate_training.check_losses`` checks it)."""
    if isinstance(value, (list, tuple)):
        return [to_loss(item) for item in value]
    if not isinstance(value, str):
        return value
    import torch

    key = value.strip().lower().replace("-", "_")
    modules = {module.lower(): module for module in LOSS_NAMES.values()}
    module = LOSS_NAMES.get(key) or modules.get(key) or modules.get(key.replace("_", ""))
    if module is None:
        close = difflib.get_close_matches(key, [*LOSS_NAMES, *modules], n=1, cutoff=0.6)
        meant = f" (did you mean loss='{close[0]}'?)" if close else ""
        raise ValueError(
            f"loss: {value!r} is not a loss name{meant}; loss takes a loss module "
            "(loss=torch.nn.MSELoss()), a function (output, label) -> scalar tensor, or one "
            f"of the names {loss_names()}"
        )
    return getattr(torch.nn, module)()


def to_verbose(value: bool | int) -> bool:
    """A boolean, or Horovod's levels 0, 1 and 2 (2, per-epoch lines there, shows the same
    as 1 here: the bar already shows every epoch)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        if value not in (0, 1, 2):
            raise ValueError(f"verbose: expected True/False or 0, 1 or 2, got {value!r}")
        return bool(value)
    raise TypeError(f"verbose: expected True/False or 0, 1 or 2, got {value!r}")


NO_DEFAULT: Any = object()  # a param that has no default (isDefined is False until set)


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """The one definition of a param: its name, doc, type converter and default."""

    name: str
    doc: str
    converter: Callable[[Any], Any] = TypeConverters.identity
    default: Any = NO_DEFAULT
    # the type a user gives, as an annotation (the constructors' and setters'), where the
    # converter does not say it (object params; their names resolve in the generated
    # constructors' module)
    hint: str | None = None

    def param(self) -> Param:
        return Param(Params._dummy(), self.name, self.doc, typeConverter=self.converter)

    def with_doc(self, doc: str, hint: str | None = None) -> ParamSpec:
        """The same param described for another stage (e.g. ``model``: what it trains)."""
        return dataclasses.replace(self, doc=doc, hint=hint or self.hint)


def param_specs(cls: type) -> dict[str, ParamSpec]:
    """Every ParamSpec ``cls`` declares or inherits, by name (a subclass's own comes last)."""
    specs: dict[str, ParamSpec] = {}
    for klass in reversed(cls.__mro__):
        specs.update({spec.name: spec for spec in vars(klass).get("_specs", ())})
    return specs


class SpecParams(Params):
    """Params declared as ``_specs``: a class gets the Param of each of its own specs as the
    attribute of that name, and an instance gets every spec's default."""

    _specs: ClassVar[tuple[ParamSpec, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for spec in vars(cls).get("_specs", ()):
            setattr(cls, spec.name, spec.param())

    def __init__(self):
        super().__init__()
        specs = param_specs(type(self)).values()
        self._setDefault(**{s.name: s.default for s in specs if s.default is not NO_DEFAULT})

    def _init_keywords(self, keywords: dict[str, Any]) -> None:
        """What a stage's constructor (``driver/constructors``) does with the keywords
        given: sets them as params."""
        self._set(**keywords)


# snake_case spellings of Spark's param names; the Params keep Spark's names
SPARK_ALIASES = {"probability_col": "probabilityCol", "raw_prediction_col": "rawPredictionCol"}


def spark_names(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the snake_case spellings of SPARK_ALIASES given Spark's names; both
    spellings of one param are refused unless they agree."""
    named = dict(kwargs)
    for alias, name in SPARK_ALIASES.items():
        if alias in named:
            value = named.pop(alias)
            if name in named and named[name] != value:
                raise ValueError(
                    f"{alias}, {name}: two spellings of one param with different values "
                    f"({value!r} and {named[name]!r}); give one of them"
                )
            named[name] = value
    return named


# Spark ML's names of column params these stages name otherwise: a keyword or param set by
# one of them is refused, naming ours (Spark ML's `featuresCol` is one vector column; ours
# take a list)
SPARK_ML_NAMES = {
    "featuresCol": "feature_cols",
    "labelCol": "label_cols",
    "predictionCol": "output_cols",
}


# names other libraries give these params (Horovod's and Keras's estimators, Lightning's
# Trainer, Hugging Face's and PyTorch's own loops): an unknown keyword that is one of them
# is answered with ours first, where the stage has them
FOREIGN_NAMES = {
    "lr": ("learning_rate", "lr_scheduler"),
    "learning_rate_init": ("learning_rate",),
    "scheduler": ("lr_scheduler",),
    "lr_schedule": ("lr_scheduler",),
    "epoch": ("epochs",),
    "num_epochs": ("epochs",),
    "n_epochs": ("epochs",),
    "max_epochs": ("epochs",),
    "num_train_epochs": ("epochs",),
    "batchsize": ("batch_size",),
    "train_batch_size": ("batch_size",),
    "per_device_train_batch_size": ("batch_size",),
    "np": ("num_proc",),
    "num_processes": ("num_proc",),
    "world_size": ("num_proc",),
    "num_workers": ("num_proc", "reader_num_workers", "decode_workers"),
    "devices": ("num_proc", "use_gpu"),
    "gpus": ("use_gpu",),
    "accelerator": ("use_gpu",),
    "device": ("use_gpu",),
    "use_cuda": ("use_gpu",),
    "criterion": ("loss",),
    "loss_fn": ("loss",),
    "loss_function": ("loss",),
    "loss_func": ("loss",),
    "losses": ("loss",),
    "optim": ("optimizer",),
    "opt": ("optimizer",),
    "seed": ("random_seed",),
    "random_state": ("random_seed",),
    "features": ("feature_cols",),
    "feature_col": ("feature_cols",),
    "features_col": ("feature_cols",),
    "input_cols": ("feature_cols",),
    "inputs": ("feature_cols",),
    "label": ("label_cols",),
    "labels": ("label_cols",),
    "label_col": ("label_cols",),
    "target": ("label_cols",),
    "targets": ("label_cols",),
    "target_col": ("label_cols",),
    "output_col": ("output_cols",),
    "prediction_col": ("output_cols",),
    "outputs": ("output_cols",),
    "validation_split": ("validation",),
    "val_split": ("validation",),
    "validation_fraction": ("validation",),
    "validation_col": ("validation",),
    "steps_per_epoch": ("train_steps_per_epoch",),
    "limit_train_batches": ("train_steps_per_epoch",),
    "validation_steps": ("validation_steps_per_epoch",),
    "limit_val_batches": ("validation_steps_per_epoch",),
    "gradient_accumulation_steps": ("backward_passes_per_step",),
    "accumulate_grad_batches": ("backward_passes_per_step",),
    "precision": ("mixed_precision",),
    "amp": ("mixed_precision",),
    "use_amp": ("mixed_precision",),
    "fp16": ("mixed_precision",),
    "sample_weight": ("sample_weight_col",),
    "sample_weights": ("sample_weight_col",),
    "weight_col": ("sample_weight_col",),
    "transform_fn": ("transformation_fn",),
    "module": ("model",),
    "net": ("model",),
    "network": ("model",),
    "callback": ("callbacks",),
    "timeout": ("collective_timeout", "elastic_timeout", "decode_timeout"),
}


def check_keywords(stage: Params, kwargs: dict[str, Any], known: list[str] | None = None) -> None:
    """Spark ML's names of column params refused naming ours (``check_spark_ml_names``),
    then any keyword that is not one of ``known`` (default: ``stage``'s params and their
    snake_case aliases): a TypeError naming the class the user called and the params
    closest to what was typed (``FOREIGN_NAMES`` and ours that begin with it, else the
    spellings ``difflib`` finds close)."""
    check_spark_ml_names(stage, kwargs)
    if known is None:
        unknown = [n for n in kwargs if n not in SPARK_ALIASES and not stage.hasParam(n)]
        known = [p.name for p in stage.params] + list(SPARK_ALIASES) if unknown else []
    else:
        unknown = [name for name in kwargs if name not in known]
    if unknown:
        cls = type(stage).__name__
        raise TypeError("; ".join(_not_a_param(cls, n, kwargs[n], known) for n in unknown))


def _not_a_param(cls: str, name: str, value: Any, known: list[str]) -> str:
    params = [k for k in known if not k.startswith("_")]
    close = [k for k in FOREIGN_NAMES.get(name.lower(), ()) if k in params]
    close += [k for k in params if k.startswith(name + "_")]
    if not close:
        close = difflib.get_close_matches(name, params, n=3, cutoff=0.75)
    close = list(dict.fromkeys(close))[:4]
    if not close and "trainer_args" in params:
        if name in ("lr", "learning_rate"):
            return (
                f"{name}: not a param of {cls}; the LightningModule's configure_optimizers() "
                "sets the learning rate"
            )
        if name in _trainer_arguments():
            return (
                f"{name}: not a param of {cls}; a Lightning Trainer argument goes in "
                f"trainer_args={{'{name}': {value!r}}}"
            )
    if not close:
        return (
            f"{name}: not a param of {cls}; {cls}().explainParams() and docs/parameters.md "
            "list them"
        )
    shown = repr(value)
    first = f"{close[0]}={shown if len(shown) <= 40 else '...'}"
    others = f" (or {', '.join(close[1:])})" if close[1:] else ""
    return f"{name}: not a param of {cls}; did you mean {first}{others}?"


def _trainer_arguments() -> set[str]:
    """The keyword arguments of Lightning's Trainer (none where Lightning is missing)."""
    try:
        from lightning.pytorch import Trainer
    except ImportError:
        return set()
    return set(inspect.signature(Trainer.__init__).parameters) - {"self"}


def check_spark_ml_names(stage: Params, kwargs: dict[str, Any]) -> None:
    """A TypeError naming ``SPARK_ML_NAMES``' param of ``stage`` for any of Spark ML's names
    in ``kwargs``."""
    for name, ours in SPARK_ML_NAMES.items():
        if name in kwargs and ours in param_specs(type(stage)):
            value = kwargs[name]
            given = [value] if isinstance(value, str) else value
            raise TypeError(
                f"{name}: is Spark ML's name; {type(stage).__name__} takes {ours}, a list of "
                f"column names: {ours}={given!r}"
            )


def spark_ml_keywords(init):
    """Wraps a stage's ``__init__`` (outside ``keyword_only``) so that Spark ML's names of
    its column params, and keywords it does not take, are refused naming the class called
    and the params meant (``check_keywords``), not with Python's bare TypeError, which
    names the generated constructor."""
    known = [name for name in inspect.signature(init).parameters if name != "self"]

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        check_keywords(self, kwargs, known)
        return init(self, *args, **kwargs)

    return wrapper
