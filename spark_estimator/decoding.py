"""Helpers for a ``decode_fn``: images from their bytes or Spark's image struct, and the
random crops and flips of augmentation, as uint8 ``[C, H, W]`` tensors.

A ``decode_fn(row, augment)`` gets one row's variable columns (encoded images as bytes,
Spark's image struct as a dict, strings, arrays of varying length as 1-D NumPy arrays) and
returns their tensors; ``augment`` is a ``numpy.random.Generator`` seeded by (random_seed,
epoch, row) in training, None in validation and ``transform``, where nothing random should
be done. What a fit does without one is ``default_decode``. For example::

    from spark_estimator.decoding import decode_image, random_crop, random_flip

    def decode(row, augment):
        image = decode_image(row["content"], size=(36, 36))
        if augment is None:
            return {"content": center_crop(image, 32)}
        return {"content": random_flip(random_crop(image, 32, augment), augment)}

Decoding uses Pillow (``pip install 'spark-estimator[vision]'``), which releases the GIL
while it decodes, so a rank's decoding threads run in parallel.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# Spark's image source (OpenCV's types): channels per mode it writes, BGR order
_CV_MODES = {0: 1, 16: 3, 24: 4}


def decode_image(
    data: bytes, mode: str = "RGB", size: tuple[int, int] | None = None, depth: int = 8
) -> torch.Tensor:
    """An encoded image (JPEG, PNG, ... any format Pillow reads) as a tensor ``[C, H, W]``
    in Pillow's ``mode`` (``"RGB"``: 3 channels, ``"L"``: 1), resized to ``size`` (height,
    width) when given (JPEGs are decoded at a reduced scale first where that is enough,
    which is faster).

    ``depth=8`` (the default) gives uint8 values: a 16-bit grayscale image (PNG, TIFF:
    Pillow's modes ``I;16`` and ``I``) is scaled to 8 bits keeping its range (value / 257,
    rounded), where Pillow's own conversion would saturate it. ``depth=16`` gives int32
    values 0 to 65535: a 16-bit image's own, an 8-bit image's times 257 (``mode`` "L" or
    "RGB" for a 16-bit image). The tensor is a channels-last view of the pixels
    (``.contiguous()`` before ``.view()``). Raises Pillow's error for bytes that are not an
    image."""
    import io

    if depth not in (8, 16):
        raise ValueError(f"depth: 8 (uint8 values) or 16 (int32 values to 65535), got {depth!r}")
    try:
        from PIL import Image
    except ImportError as e:
        raise ImportError(
            "decoding images needs Pillow: pip install 'spark-estimator[vision]'"
        ) from e
    with Image.open(io.BytesIO(data)) as image:
        if image.mode in _SIXTEEN_BIT:
            values = _sixteen_bit(image, size)
            if depth == 16:
                return _chw(_channels(values, mode), copy=False)
            image = Image.fromarray(((values + 128) // 257).astype(np.uint8), "L")
        if size is not None:
            image.draft(mode, (size[1], size[0]))
        image = image.convert(mode)
        if size is not None and image.size != (size[1], size[0]):
            image = image.resize((size[1], size[0]), Image.BILINEAR)
        array = np.array(image)  # the one copy of the pixels (writable, [H, W, C])
    if depth == 16:
        return _chw(array.astype(np.int32) * 257, copy=False)
    return _chw(array, copy=False)


# Pillow's modes of 16-bit grayscale images (and its 32-bit integer one, read as 16 bits)
_SIXTEEN_BIT = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})


def _sixteen_bit(image, size: tuple[int, int] | None) -> np.ndarray:
    """A 16-bit grayscale image's values (int32 ``[H, W]``, 0 to 65535), resized first."""
    from PIL import Image

    image = image.convert("I")
    if size is not None and image.size != (size[1], size[0]):
        image = image.resize((size[1], size[0]), Image.BILINEAR)
    return np.clip(np.asarray(image), 0, 65535).astype(np.int32)


def _channels(values: np.ndarray, mode: str) -> np.ndarray:
    """One grayscale channel ``[H, W]`` as ``mode``'s channels ``[H, W, C]``."""
    if mode not in ("L", "RGB"):
        raise ValueError(
            f"mode: a 16-bit grayscale image decodes with depth=16 to 'L' or 'RGB', not {mode!r}"
        )
    return np.repeat(values[:, :, None], 1 if mode == "L" else 3, axis=2)


def image_from_struct(image: dict) -> torch.Tensor:
    """A row of Spark's image source (``spark.read.format("image")``: height, width,
    nChannels, mode and BGR bytes in ``data``) as a uint8 tensor ``[C, H, W]`` in RGB (or
    RGBA, or 1 channel for grayscale)."""
    height, width, channels = image["height"], image["width"], image["nChannels"]
    if _CV_MODES.get(image["mode"]) != channels:
        raise ValueError(
            f"image mode {image['mode']} with {channels} channels is not one of the 8-bit "
            "types Spark's image source writes (CV_8UC1, CV_8UC3, CV_8UC4)"
        )
    array = np.frombuffer(image["data"], dtype=np.uint8).reshape(height, width, channels)
    if channels >= 3:  # BGR(A) -> RGB(A)
        array = array[..., [2, 1, 0, *range(3, channels)]]
    return _chw(array)


def _chw(array: np.ndarray, copy: bool = True) -> torch.Tensor:
    """An ``[H, W]`` or ``[H, W, C]`` array as a ``[C, H, W]`` tensor: a contiguous
    copy, or without ``copy`` a view of ``array`` (a writable array of its own; the batch's
    ``torch.stack`` makes the one copy then, about a tenth of a 128x128 JPEG's decoding)."""
    if array.ndim == 2:
        array = array[:, :, None]
    if not copy:
        return torch.from_numpy(array).permute(2, 0, 1)
    return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))


def _pair(size) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def center_crop(image: torch.Tensor, size) -> torch.Tensor:
    """The ``size`` (an int, or (height, width)) middle of an image ``[C, H, W]``."""
    height, width = _pair(size)
    top = (image.shape[-2] - height) // 2
    left = (image.shape[-1] - width) // 2
    _check_fits(image, height, width)
    return image[..., top : top + height, left : left + width]


def random_crop(
    image: torch.Tensor, size, augment: np.random.Generator, padding: int = 0
) -> torch.Tensor:
    """A ``size`` crop of an image ``[C, H, W]`` at a place drawn from ``augment``, after
    padding its borders with ``padding`` zeros."""
    height, width = _pair(size)
    if padding:
        image = torch.nn.functional.pad(image, (padding,) * 4)
    _check_fits(image, height, width)
    top = int(augment.integers(0, image.shape[-2] - height + 1))
    left = int(augment.integers(0, image.shape[-1] - width + 1))
    return image[..., top : top + height, left : left + width]


def random_flip(image: torch.Tensor, augment: np.random.Generator, p: float = 0.5):
    """An image ``[C, H, W]`` mirrored left to right with probability ``p``."""
    return image.flip(-1) if augment.random() < p else image


def resize(image: torch.Tensor, size) -> torch.Tensor:
    """An image ``[C, H, W]`` (uint8 or float) resized to ``size`` (bilinear, antialiased),
    in its dtype."""
    height, width = _pair(size)
    resized = torch.nn.functional.interpolate(
        image[None].float(), size=(height, width), mode="bilinear", antialias=True
    )[0]
    if image.dtype == torch.uint8:
        return resized.round().clamp(0, 255).to(torch.uint8)
    return resized.to(image.dtype)


def _check_fits(image: torch.Tensor, height: int, width: int) -> None:
    if image.shape[-2] < height or image.shape[-1] < width:
        raise ValueError(
            f"an image of {image.shape[-2]}x{image.shape[-1]} is smaller than the crop "
            f"{height}x{width}; resize it first"
        )


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
