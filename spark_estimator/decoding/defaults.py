"""What a fit does with a row's variable columns without a ``decode_fn``."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .images import decode_image, image_from_struct


def default_decode(row: dict[str, Any], kinds: dict[str, str]) -> dict[str, Any]:
    """What a fit does with a row's variable columns without a ``decode_fn``: encoded images
    (``kinds[name] == "binary"``) decoded with ``decode_image`` (RGB), Spark's image
    structs with ``image_from_struct``, arrays of varying length as 1-D tensors, strings
    left as they are."""
    out = {}
    for name, value in row.items():
        kind = kinds.get(name)
        if kind == "binary":
            out[name] = decode_image(value)
        elif kind == "image":
            out[name] = image_from_struct(value)
        elif kind == "sequence":
            out[name] = torch.from_numpy(np.asarray(value))
        else:
            out[name] = value
    return out
