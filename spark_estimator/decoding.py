"""Helpers for a ``decode_fn``: images from their bytes or Spark's image struct, and the
random crops and flips of augmentation, as uint8 ``[C, H, W]`` tensors; and the same for a
whole batch at once (``decode_images``, the crops and flips of ``[B, C, H, W]``), which is
what a fit does without a ``decode_fn``.

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
while it decodes, so a rank's decoding threads run in parallel. ``decode_images`` decodes
JPEGs with simplejpeg (in the same extra) where it imports: it holds the GIL for a few
microseconds per image where Pillow holds it for about a hundred (docs/images-and-text.md,
"The default image decoding"), and gives the same pixels.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
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


# -- a batch of encoded images into one buffer --------------------------------------------------
class BadImage(ValueError):
    """An image of a batch that could not be decoded (``decode_images``, ``image_sizes``).

    Attributes
    ----------
    index : int
        The image's place in the batch (0 for the first).

    The decoder's error is ``__cause__``, and its type and message end this error's
    message, so that they survive pickling (a ``BadImage`` pickled to another process keeps
    ``index`` and the message, not ``__cause__``).
    """

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index

    def __reduce__(self):
        return type(self), (self.index, str(self))


_CHANNELS = {"RGB": 3, "L": 1}
# JPEG colour spaces (simplejpeg's names) that go to Pillow: its CMYK conversion is Pillow's
_TO_PILLOW = frozenset({"CMYK", "YCCK"})


def _simplejpeg():
    """The simplejpeg module where it imports, else None (Pillow decodes everything then)."""
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg


def _pil_image():
    try:
        from PIL import Image
    except ImportError as e:
        raise ImportError(
            "decoding images needs Pillow: pip install 'spark-estimator[vision]'"
        ) from e
    return Image


def _bad(index: int, error: BaseException) -> BadImage:
    return BadImage(
        index, f"image {index} of the batch could not be decoded: {type(error).__name__}: {error}"
    )


def image_sizes(data: Sequence[bytes]) -> list[tuple[int, int]]:
    """The (height, width) of each encoded image of a batch, from its header alone.

    JPEGs' headers are read by simplejpeg where it imports, other images' (and every
    image's without it) by Pillow's lazy ``Image.open``, which reads no pixels. An image
    decodes to height x width x channels bytes (3 for ``mode="RGB"``, 1 for ``"L"``), the
    size of its slot in ``decode_images``' buffer without ``size=``.

    Parameters
    ----------
    data : sequence of bytes
        Encoded images (bytes or any bytes-like object), as a binary column's rows arrive.

    Returns
    -------
    list of (int, int)
        Each image's (height, width), in the order of ``data``.

    Raises
    ------
    BadImage
        For an image whose header neither reads, naming its index in ``data``.
    """
    simplejpeg = _simplejpeg()
    return [_size_of(simplejpeg, image, index) for index, image in enumerate(data)]


def _size_of(simplejpeg, image, index: int) -> tuple[int, int]:
    if simplejpeg is not None:
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(image)
            return height, width
        except Exception:
            pass  # not a JPEG, or one libjpeg-turbo's header reader refuses: Pillow's turn
    Image = _pil_image()
    try:
        with Image.open(io.BytesIO(image)) as opened:
            width, height = opened.size
    except Exception as e:
        raise _bad(index, e) from e
    return height, width


def decode_images(
    data: Sequence[bytes],
    mode: str = "RGB",
    size: tuple[int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A batch of encoded images decoded into one uint8 buffer, as ``[B, C, H, W]``.

    The batch's pixels are one ``[B, H, W, C]`` buffer (``out`` when given) and the result
    is its channels-last view ``[B, C, H, W]``, as ``decode_image``'s is of one image's
    (``.contiguous()`` before ``.view()``; ``torch.channels_last`` convolutions take it as
    it is). JPEGs are decoded by simplejpeg where it imports, straight into their slot of
    the buffer: one call reads the header, one decodes, and simplejpeg releases the GIL
    while it reads and decodes, so decoding threads run in parallel and the process's
    other threads run meanwhile. Everything else goes through ``decode_image`` (Pillow)
    into its slot: other formats (PNG, ...), 16-bit images (scaled to 8 bits keeping
    their range, as ``decode_image`` does), CMYK JPEGs, JPEGs that simplejpeg refuses, and
    every image when simplejpeg does not import.

    The pixels are ``decode_image``'s with the same ``mode`` and ``size``: simplejpeg and
    Pillow both decode with libjpeg-turbo with the same settings (accurate DCT, smooth
    chroma upsampling, the same reduced scale), and were measured equal (simplejpeg 1.9.0,
    Pillow 13.0) for colour and grayscale JPEGs of 4:4:4, 4:2:2 and 4:2:0 subsampling,
    qualities 50 to 100, baseline and progressive, with and without ``size``. A colour
    JPEG decoded to ``"L"`` is converted from its RGB pixels with Pillow's weights, as
    ``decode_image`` does without ``size``; with ``size`` both take the JPEG's own luma
    (libjpeg's grayscale output, what Pillow's ``draft`` asks for), which differs from
    that conversion by up to about 20 levels on up to 9% of the pixels. Were the two
    libraries' libjpeg-turbo to change how they decode, pixels could differ from Pillow's
    by a JPEG decoder's rounding.

    Thread-safe: each call decodes with its own decoder state; threads may fill disjoint
    rows of one ``out`` (slices of it) at once.

    Parameters
    ----------
    data : sequence of bytes
        The encoded images (bytes or any bytes-like object), as a binary column's rows
        arrive.
    mode : {"RGB", "L"}
        3 channels (RGB) or 1 (grayscale).
    size : (int, int), optional
        (height, width) every image is resized to (bilinear, as ``decode_image``; JPEGs
        are decoded at a reduced scale first where that is enough, which is faster, and
        not resized at all where that scale gives ``size``). Without it every image must
        have the same size.
    out : torch.Tensor, optional
        A preallocated, contiguous uint8 CPU tensor ``[B, H, W, C]`` to decode into (a
        shared-memory slot, say); the result is then a view of it. Its (H, W) is ``size``
        when given, else the images' own size. ``image_sizes`` tells the images' sizes
        from their headers, to allocate it.

    Returns
    -------
    torch.Tensor
        uint8 ``[B, C, H, W]``, a channels-last view of ``out`` (or of a new buffer).

    Raises
    ------
    BadImage
        For an image that neither decoder decodes (a ``ValueError`` with ``index``, its
        place in ``data``, and the decoder's error as ``__cause__``).
    ValueError
        For images of different sizes without ``size`` (naming both), an ``out`` of the
        wrong shape, dtype or layout, or an unknown ``mode``.
    ImportError
        Where an image needs Pillow and it is not installed.

    Examples
    --------
    >>> batch = decode_images(rows, size=(128, 128))  # doctest: +SKIP
    >>> batch.shape, batch.is_contiguous(memory_format=torch.channels_last)  # doctest: +SKIP
    (torch.Size([256, 3, 128, 128]), True)
    """
    channels = _CHANNELS.get(mode)
    if channels is None:
        raise ValueError(f"mode: 'RGB' (3 channels) or 'L' (1 channel), got {mode!r}")
    if size is not None:
        size = _pair(size)
    rows = len(data)
    simplejpeg = _simplejpeg()
    if out is None:
        if size is not None:
            shape = size
        else:
            shape = _size_of(simplejpeg, data[0], 0) if rows else (0, 0)
        out = torch.empty((rows, *shape, channels), dtype=torch.uint8)
        where = f"image 0 is {shape[0]}x{shape[1]}"
    else:
        _check_out(out, rows, channels, size)
        where = f"out holds {out.shape[1]}x{out.shape[2]}"
    pixels = out.numpy()
    if simplejpeg is None:
        for index, image in enumerate(data):
            _pillow_into(pixels, index, image, mode, size, where)
    elif size is None:
        _jpegs_as_they_are(simplejpeg, data, pixels, mode, where)
    else:
        for index, image in enumerate(data):
            if not _jpeg_resized(simplejpeg, image, pixels[index], mode, size):
                _pillow_into(pixels, index, image, mode, size, where)
    return out.permute(0, 3, 1, 2)


def _check_out(out, rows: int, channels: int, size: tuple[int, int] | None) -> None:
    if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 4:
        got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out)
        raise ValueError(f"out: a uint8 tensor [B, H, W, C], got {got}")
    if out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError("out: a contiguous CPU tensor (the decoders write into its memory)")
    if out.shape[0] != rows or out.shape[3] != channels:
        raise ValueError(
            f"out: {tuple(out.shape)} does not hold {rows} images of {channels} channel(s) "
            f"(out is [B, H, W, C])"
        )
    if size is not None and tuple(out.shape[1:3]) != size:
        raise ValueError(f"out: {tuple(out.shape)} is not of size={size} ([B, H, W, C])")


def _different(index: int, height: int, width: int, where: str) -> ValueError:
    return ValueError(
        f"images of different sizes in one batch ({where}, image {index} is "
        f"{height}x{width}); decode_images puts them in one buffer: give size= to resize "
        "them to one size, or decode them with a decode_fn"
    )


def _pillow_into(pixels: np.ndarray, index: int, image, mode: str, size, where: str) -> None:
    """Image ``index`` decoded by ``decode_image`` into its slot ``pixels[index]``."""
    try:
        decoded = decode_image(image, mode, size)
    except ImportError:
        raise
    except Exception as e:
        raise _bad(index, e) from e
    array = decoded.permute(1, 2, 0).numpy()  # the [H, W, C] array decode_image made
    if array.shape != pixels.shape[1:]:
        raise _different(index, array.shape[0], array.shape[1], where)
    pixels[index] = array


def _jpegs_as_they_are(simplejpeg, data, pixels: np.ndarray, mode: str, where: str) -> None:
    """The batch without ``size``: each JPEG decoded straight into its slot (for ``"L"``, a
    colour JPEG into a scratch RGB buffer first, converted at the end as Pillow does)."""
    height, width = pixels.shape[1:3]
    header, decode = simplejpeg.decode_jpeg_header, simplejpeg.decode_jpeg
    slots = list(pixels)
    gray = mode == "L"
    colour: list[int] = []  # for "L": the colour JPEGs, their RGB in scratch[0], [1], ...
    scratch = None
    for index, image in enumerate(data):
        try:
            h, w, space, _ = header(image)
        except Exception:
            _pillow_into(pixels, index, image, mode, None, where)
            continue
        if h != height or w != width:
            raise _different(index, h, w, where)
        if space in _TO_PILLOW:
            _pillow_into(pixels, index, image, mode, None, where)
            continue
        to_luma = gray and space != "Gray"  # a colour JPEG for "L": its RGB, converted later
        if to_luma and scratch is None:
            scratch = np.empty((len(slots), height, width, 3), dtype=np.uint8)
        buffer = scratch[len(colour)] if to_luma else slots[index]
        try:
            decode(image, "GRAY" if gray and not to_luma else "RGB", buffer=buffer)
        except Exception:
            _pillow_into(pixels, index, image, mode, None, where)
            continue
        if to_luma:
            colour.append(index)
    if colour:
        _luma_into(pixels, colour, scratch[: len(colour)])


def _luma_into(pixels: np.ndarray, rows: list[int], rgb: np.ndarray) -> None:
    """RGB images ``[n, H, W, 3]`` converted to Pillow's "L" (its integer weights, one
    conversion for them all) into the slots ``rows`` of ``pixels``."""
    count, height, width, _ = rgb.shape
    luma = _pil_image().fromarray(rgb.reshape(count * height, width, 3)).convert("L")
    pixels[rows, :, :, 0] = np.asarray(luma).reshape(count, height, width)


def _jpeg_resized(simplejpeg, image, slot: np.ndarray, mode: str, size) -> bool:
    """A JPEG decoded at the reduced scale ``decode_image`` (Pillow's ``draft``) picks and
    resized to ``size`` into ``slot``; False where it is left to Pillow (not a JPEG, CMYK,
    refused, or libjpeg-turbo picking another scale, which it may for images under 8
    pixels)."""
    height, width = size
    try:
        h, w, space, _ = simplejpeg.decode_jpeg_header(image)
    except Exception:
        return False
    if space in _TO_PILLOW:
        return False
    ratio = min(w // width, h // height)  # Pillow's draft: 1/8, 1/4, 1/2 or 1, at least size
    scale = next((s for s in (8, 4, 2, 1) if ratio >= s), 1)
    scaled = (-(-h // scale), -(-w // scale))
    hints = {} if scale == 1 else {"min_height": scaled[0], "min_width": scaled[1]}
    colorspace = "GRAY" if mode == "L" else "RGB"  # draft("L") decodes to the JPEG's luma
    direct = scaled == (height, width)
    try:
        if direct:
            decoded = simplejpeg.decode_jpeg(image, colorspace, buffer=slot, **hints)
        else:
            decoded = simplejpeg.decode_jpeg(image, colorspace, **hints)
    except Exception:
        return False
    if decoded.shape[:2] != scaled:
        return False
    if not direct:
        Image = _pil_image()
        picture = Image.fromarray(decoded[:, :, 0] if mode == "L" else decoded)
        slot[...] = np.asarray(picture.resize((width, height), Image.BILINEAR)).reshape(slot.shape)
    return True


def _pair(size) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


# -- crops, flips and resizing, of an image or a batch -----------------------------------------
def center_crop(image: torch.Tensor, size) -> torch.Tensor:
    """The ``size`` middle of an image ``[C, H, W]`` or of each image of a batch
    ``[B, C, H, W]``.

    Parameters
    ----------
    image : torch.Tensor
        ``[C, H, W]`` or ``[B, C, H, W]``, on any device.
    size : int or (int, int)
        The crop's (height, width).

    Returns
    -------
    torch.Tensor
        A view of ``image``.
    """
    height, width = _pair(size)
    top = (image.shape[-2] - height) // 2
    left = (image.shape[-1] - width) // 2
    _check_fits(image, height, width)
    return image[..., top : top + height, left : left + width]


def random_crop(image: torch.Tensor, size, augment, padding: int = 0) -> torch.Tensor:
    """A ``size`` crop of an image ``[C, H, W]`` at a place drawn from ``augment``, after
    padding its borders with ``padding`` zeros; or of each image of a batch
    ``[B, C, H, W]``, each at a place drawn from its own generator.

    A batch's row gets the crop the same image would get alone with the same generator
    (the same draws, in the same order), so decoding a row alone or in a batch makes no
    difference. The batch's crops are cut in one ``index_select`` on the tensor's device,
    whatever B (the places are drawn on the CPU).

    Parameters
    ----------
    image : torch.Tensor
        ``[C, H, W]`` or ``[B, C, H, W]``, on any device.
    size : int or (int, int)
        The crop's (height, width).
    augment : numpy.random.Generator or list of numpy.random.Generator
        One generator for an image; B generators, one per row, for a batch.
    padding : int
        Zeros added on each border before cropping.

    Returns
    -------
    torch.Tensor
        The crop ``[C, h, w]`` (a view of ``image`` without padding), or the batch's crops
        ``[B, C, h, w]`` (a new tensor, channels-last where ``image`` is).

    Raises
    ------
    ValueError
        For an image smaller than the crop, or ``augment`` not one generator per row.
    """
    height, width = _pair(size)
    generators = _generators(image, augment)
    if padding:
        image = torch.nn.functional.pad(image, (padding,) * 4)
    _check_fits(image, height, width)
    if generators is None:
        top = int(augment.integers(0, image.shape[-2] - height + 1))
        left = int(augment.integers(0, image.shape[-1] - width + 1))
        return image[..., top : top + height, left : left + width]
    rows, cols = image.shape[-2] - height + 1, image.shape[-1] - width + 1
    places = [(int(g.integers(0, rows)), int(g.integers(0, cols))) for g in generators]
    return _crops(image, places, height, width)


def _crops(image: torch.Tensor, places: list[tuple[int, int]], height: int, width: int):
    """Crops of one size, image ``b``'s at ``places[b]`` (top, left), in one gather: every
    crop line is a contiguous run of the tensor's memory, so an ``index_select`` of the
    runs' starts from an overlapping view of the memory copies them, a memcpy each."""
    batch, channels, full_h, full_w = image.shape
    if batch == 0:
        return image[..., :height, :width].clone()
    device = image.device
    where = torch.tensor(places, dtype=torch.long).to(device)
    b = torch.arange(batch, device=device)
    lines = torch.arange(height, device=device)
    if not image.is_contiguous() and image.is_contiguous(memory_format=torch.channels_last):
        flat = image.permute(0, 2, 3, 1).reshape(-1)  # [B, H, W, C] memory
        run = width * channels
        starts = (
            b[:, None] * (full_h * full_w * channels)
            + (where[:, :1] + lines) * (full_w * channels)
            + where[:, 1:] * channels
        )
        shape, order = (batch, height, width, channels), (0, 3, 1, 2)
    else:
        flat = image.contiguous().reshape(-1)  # [B, C, H, W] memory
        run = width
        c = torch.arange(channels, device=device)
        starts = ((b[:, None] * channels + c) * (full_h * full_w))[:, :, None] + (
            (where[:, :1] + lines) * full_w + where[:, 1:]
        )[:, None, :]
        shape, order = (batch, channels, height, width), (0, 1, 2, 3)
    runs = flat.as_strided((flat.numel() - run + 1, run), (1, 1))
    return runs.index_select(0, starts.reshape(-1)).view(shape).permute(order)


def _channels_innermost(image: torch.Tensor) -> bool:
    """Whether ``image`` ``[C, H, W]`` has its channels innermost in memory, not being
    contiguous: ``decode_image``'s tensors (views of ``[H, W, C]`` pixels), their crops and
    flips."""
    return image.dim() == 3 and not image.is_contiguous() and image.stride(0) < image.stride(2)


def random_flip(image: torch.Tensor, augment, p: float = 0.5) -> torch.Tensor:
    """An image ``[C, H, W]`` mirrored left to right with probability ``p`` (drawn from
    ``augment``); or each image of a batch ``[B, C, H, W]``, each drawn from its own
    generator, as the image alone would be.

    Parameters
    ----------
    image : torch.Tensor
        ``[C, H, W]`` or ``[B, C, H, W]``, on any device.
    augment : numpy.random.Generator or list of numpy.random.Generator
        One generator for an image; B generators, one per row, for a batch.
    p : float
        The probability of a flip.

    Returns
    -------
    torch.Tensor
        The image (itself where not flipped; else a new tensor, its channels innermost in
        memory where they are in ``image``, as in ``decode_image``'s) or, for a batch, a
        new tensor in its memory layout (channels-last where ``image`` is): the drawn rows
        selected and flipped in one call each, then every row copied once into the result.

    Raises
    ------
    ValueError
        For ``augment`` not one generator per row of a batch.
    """
    generators = _generators(image, augment)
    if generators is None:
        if augment.random() >= p:
            return image
        if _channels_innermost(image):
            return image.permute(1, 2, 0).flip(1).permute(2, 0, 1)  # channels stay innermost
        return image.flip(-1)
    flipped = [row for row, g in enumerate(generators) if g.random() < p]
    # the rows as views of the layout their memory has, where a flip moves whole runs
    channels_last = image.is_contiguous(memory_format=torch.channels_last)
    if channels_last and not image.is_contiguous():
        rows, axis = image.permute(0, 2, 3, 1), 2  # [B, H, W, C]: a pixel's channels move together
    else:
        rows, axis = image.contiguous(), 3
    views = list(rows.unbind(0))
    if flipped:
        mirrored = rows.index_select(0, torch.tensor(flipped).to(image.device)).flip(axis)
        for row, view in zip(flipped, mirrored.unbind(0)):
            views[row] = view
    out = torch.stack(views) if views else rows.clone()
    return out.permute(0, 3, 1, 2) if axis == 2 else out


def resize(image: torch.Tensor, size) -> torch.Tensor:
    """An image ``[C, H, W]`` or a batch ``[B, C, H, W]`` (uint8 or float) resized to
    ``size`` (bilinear, antialiased), in its dtype; a batch's rows as each alone.

    Parameters
    ----------
    image : torch.Tensor
        ``[C, H, W]`` or ``[B, C, H, W]``, on any device.
    size : int or (int, int)
        The (height, width) to resize to.

    Returns
    -------
    torch.Tensor
        The resized image or batch, in ``image``'s dtype (uint8 values rounded).
    """
    height, width = _pair(size)
    batch = image.dim() == 4
    resized = torch.nn.functional.interpolate(
        (image if batch else image[None]).float(),
        size=(height, width),
        mode="bilinear",
        antialias=True,
    )
    if not batch:
        resized = resized[0]
    if image.dtype == torch.uint8:
        return resized.round().clamp(0, 255).to(torch.uint8)
    return resized.to(image.dtype)


def _generators(image: torch.Tensor, augment) -> list | None:
    """None for an image ``[C, H, W]`` (``augment`` is its generator), the B generators of
    a batch ``[B, C, H, W]``."""
    if image.dim() == 3:
        if isinstance(augment, (list, tuple)):
            raise ValueError(
                "augment: an image [C, H, W] takes one numpy.random.Generator, got a "
                f"{type(augment).__name__} of {len(augment)}"
            )
        return None
    if image.dim() != 4:
        raise ValueError(f"image: [C, H, W] or a batch [B, C, H, W], got {tuple(image.shape)}")
    rows = image.shape[0]
    if not isinstance(augment, (list, tuple)) or len(augment) != rows:
        got = (
            f"a {type(augment).__name__} of {len(augment)}"
            if isinstance(augment, (list, tuple))
            else f"a {type(augment).__name__}"
        )
        raise ValueError(
            f"augment: a batch of {rows} images takes a list of {rows} "
            f"numpy.random.Generator, one per row, got {got}"
        )
    return list(augment)


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
