"""cloudpickle of the user's objects (model, optimizer, loss), used on driver and executors.

Model and optimizer are pickled together, in one call, so that the optimizer's parameter
references still point at the model's parameters after unpickling on an executor: param
groups, hyper-parameters and any existing optimizer state come along unchanged.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any

import cloudpickle
import torch


def dumps(obj: Any, what: str) -> bytes:
    """cloudpickle ``obj``; a failure is a TypeError naming the parameter ``what``."""
    try:
        return cloudpickle.dumps(obj)
    except Exception as e:  # pickling raises many types (TypeError, PicklingError, ...)
        raise TypeError(
            f"{what}: cannot be serialized with cloudpickle ({type(e).__name__}: {e}). "
            "Everything passed to the estimator is shipped to the Spark executors."
        ) from e


def loads(data: bytes) -> Any:
    return cloudpickle.loads(data)


def state_to_bytes(state: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def state_from_bytes(data: bytes, weights_only: bool = True) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)


def state_dict_digest(state_dict: dict[str, torch.Tensor]) -> str:
    """A short hash of a state dict's values, equal on ranks that hold identical weights."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu().contiguous()
        h.update(name.encode())
        h.update(t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.float().numpy().tobytes())
    return h.hexdigest()[:16]
