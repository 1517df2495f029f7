"""Images one at a time: an encoded image (``decode_image``: Pillow) or a row of Spark's
image source (``image_from_struct``) as a uint8 ``[C, H, W]`` tensor, a channels-last view
of its pixels."""

from __future__ import annotations

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
