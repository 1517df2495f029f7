"""The machinery of the stages' Spark ML Params (driver side): ``ParamSpec``, the one
definition of a param (name, doc, type converter, default); ``SpecParams``, which makes the
``pyspark.ml.param.Param`` of each spec a class declares (``_specs``) and sets the
defaults; the type converters the specs name; and the names of Spark's own params:
snake_case spellings accepted for Spark's (``SPARK_ALIASES``) and Spark ML's names of
column params that are refused, naming ours (``SPARK_ML_NAMES``). The params themselves are
declared in the ``driver.params`` module.
"""

from __future__ import annotations

import dataclasses
import functools
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
    its column params are refused naming ours, not with Python's bare TypeError."""

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        check_spark_ml_names(self, kwargs)
        return init(self, *args, **kwargs)

    return wrapper
