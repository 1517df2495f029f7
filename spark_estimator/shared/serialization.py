"""cloudpickle of the user's objects (model, optimizer, loss), used on driver and executors,
and torch state (tensors, plain containers) to and from bytes.

Two kinds of loading, kept apart on purpose:

- ``loads`` unpickles: it can run any code. It is used only for the user's own objects: the
  bundle the driver ships to its executors, and a saved stage's ``objects.pkl``, which the
  user chooses to load (``TorchModel.load`` and ``TorchEstimator.load`` trust their source,
  as ``torch.load(weights_only=False)`` does).
- ``state_from_bytes`` loads every torch file of the store (checkpoints, ``result.pt``,
  ``hvd.elastic``'s commits) and a saved model's ``weights.pt`` with
  ``torch.load(weights_only=True)``: tensors and plain containers only, no code.

Model and optimizer are pickled together, in one call, so that the optimizer's parameter
references still point at the model's parameters after unpickling on an executor: param
groups, hyper-parameters and any existing optimizer state come along unchanged.

``dumps_for_saving`` is the pickle of a saved stage: every ``Store`` and fsspec filesystem
in it is pickled without its ``storage_options`` (credentials are never written), and the
tensors of the given weights go to a separate weights-only file instead of into the pickle.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from typing import Any

import cloudpickle
import fsspec
import torch

from ..store import Store


def dumps(obj: Any, what: str) -> bytes:
    """cloudpickle ``obj``; a failure is a TypeError naming the parameter ``what``."""
    try:
        return cloudpickle.dumps(obj)
    except Exception as e:  # pickling raises many types (TypeError, PicklingError, ...)
        raise TypeError(
            f"{what}: cannot be serialized with cloudpickle ({type(e).__name__}: {e}). "
            "Everything passed to the estimator is shipped to the Spark executors."
        ) from e


def pack_functions(**functions: Any) -> bytes | None:
    """The given functions (None ones left out) in one cloudpickle, so that functions of
    one module pickled by value (a script's, a notebook's) keep sharing that module's
    globals where they are unpickled; None when none is given."""
    given = {name: fn for name, fn in functions.items() if fn is not None}
    return dumps(given, ", ".join(sorted(given))) if given else None


def loads(data: bytes) -> Any:
    """Unpickle the user's objects. This runs code: only for pickles we made or the user
    chose to trust (never for files in the store, which are weights-only)."""
    return cloudpickle.loads(data)


def state_to_bytes(state: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def state_from_bytes(data: bytes, *, weights_only: bool = True) -> Any:
    """Load a torch state file (checkpoint, ``result.pt``, ``weights.pt``, an elastic
    commit) on CPU.

    Weights-only: tensors and plain containers load, anything else that was pickled into it
    (a class instance, a function) is refused with a ``pickle.UnpicklingError`` and never
    runs. ``weights_only=False`` unpickles arbitrary objects; the library never passes it.
    """
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(
            "state: refused to load a state file holding objects other than tensors and "
            f"plain containers (torch.load(weights_only=True)): {e}"
        ) from e


def state_dict_digest(state_dict: dict[str, torch.Tensor]) -> str:
    """A short hash of a state dict's values, equal on ranks that hold identical weights."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu().contiguous()
        h.update(name.encode())
        h.update(t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.float().numpy().tobytes())
    return h.hexdigest()[:16]


# -- saved stages ---------------------------------------------------------------------------
_WEIGHT = "spark_estimator.weight"  # tag of a persistent id: (tag, key, is_parameter, grad)


def _store_without_credentials(cls: type, url: str) -> Store:
    return cls(url)


def _external(t: Any) -> bool:
    """Whether tensor ``t`` goes to the weights file (plain dense tensors and parameters)."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout == torch.strided
        and not t.is_quantized
        and t.device.type != "meta"
        and not getattr(t, "__dict__", None)  # extra attributes would be lost
    )


class _SavingPickler(cloudpickle.CloudPickler):
    def __init__(self, file, weights: dict[str, torch.Tensor]):
        super().__init__(file)
        self._keys: dict[int, tuple] = {}
        for key, t in weights.items():
            if _external(t) and id(t) not in self._keys:  # tied weights: the first name
                is_param = isinstance(t, torch.nn.Parameter)
                self._keys[id(t)] = (_WEIGHT, key, is_param, t.requires_grad)

    def persistent_id(self, obj):
        return self._keys.get(id(obj)) if isinstance(obj, torch.Tensor) else None

    def reducer_override(self, obj):
        if isinstance(obj, Store):
            return _store_without_credentials, (type(obj), obj.url)
        if isinstance(obj, fsspec.AbstractFileSystem):  # as fsspec reduces it, no options
            return fsspec.spec.make_instance, (type(obj), obj.storage_args, {})
        return super().reducer_override(obj)


class _LoadingUnpickler(pickle.Unpickler):
    def __init__(self, file, weights: dict[str, torch.Tensor]):
        super().__init__(file)
        self._weights, self._built = weights, {}

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 4 and pid[0] == _WEIGHT):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        _, key, is_param, requires_grad = pid
        if key not in self._built:  # one object per weight, so tied weights stay tied
            t = self._weights[key]
            self._built[key] = (
                torch.nn.Parameter(t, requires_grad=requires_grad)
                if is_param
                else t.requires_grad_(requires_grad)
            )
        return self._built[key]


def dumps_for_saving(
    obj: Any, what: str, weights: dict[str, torch.Tensor] | None = None
) -> tuple[bytes, bytes | None]:
    """Pickle ``obj`` for a saved stage: ``(pickle, weights file or None)``.

    Stores and fsspec filesystems inside ``obj`` lose their ``storage_options``. The
    tensors of ``weights`` (a ``state_dict(keep_vars=True)`` of a module in ``obj``) are
    left out of the pickle and returned as a plain state dict in torch's format, loadable
    with ``weights_only=True``.
    """
    buf = io.BytesIO()
    try:
        pickler = _SavingPickler(buf, weights or {})
        pickler.dump(obj)
    except Exception as e:
        raise TypeError(
            f"{what}: cannot be serialized with cloudpickle ({type(e).__name__}: {e})"
        ) from e
    external = {key for _, key, _, _ in pickler._keys.values()}
    if not external:
        return buf.getvalue(), None
    state = {k: t.detach() for k, t in (weights or {}).items() if _external(t)}
    return buf.getvalue(), state_to_bytes(state)


def loads_saved(data: bytes, weights: bytes | None = None) -> Any:
    """Unpickle what ``dumps_for_saving`` wrote. The pickle runs code (trust its source);
    the weights file is loaded weights-only first."""
    if weights is None:
        return loads(data)
    state = state_from_bytes(weights)
    return _LoadingUnpickler(io.BytesIO(data), state).load()
