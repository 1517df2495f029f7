"""A batch of encoded images at once: ``decode_images`` into one ``[B, H, W, C]`` buffer
(simplejpeg for JPEGs where it imports, else Pillow), ``image_sizes`` from their headers."""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import torch

from .images import _pair, decode_image


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
    _decode_into(data, out.numpy(), mode, size, where, None)
    return out.permute(0, 3, 1, 2)


def decode_images_into(
    data: Sequence[bytes], out: torch.Tensor, mode: str = "RGB", size=None
) -> dict[int, BadImage]:
    """``decode_images`` into ``out`` (``[B, H, W, C]``, of the images' size or ``size``)
    trying every image: the errors of those that neither decoder decodes, by their index
    (their rows of ``out`` left as they were), where ``decode_images`` raises the first. A
    bad image so costs its own decoding attempts, not another decoding of its batch."""
    channels = _CHANNELS.get(mode)
    if channels is None:
        raise ValueError(f"mode: 'RGB' (3 channels) or 'L' (1 channel), got {mode!r}")
    size = _pair(size) if size is not None else None
    _check_out(out, len(data), channels, size)
    bad: dict[int, BadImage] = {}
    where = f"out holds {out.shape[1]}x{out.shape[2]}"
    _decode_into(data, out.numpy(), mode, size, where, bad)
    return bad


def _decode_into(data, pixels: np.ndarray, mode: str, size, where: str, bad) -> None:
    """Every image of ``data`` into its row of ``pixels`` (see ``decode_images``); with
    ``bad`` (a dict) an image that does not decode is recorded there, else raised."""
    simplejpeg = _simplejpeg()
    if simplejpeg is None:
        for index, image in enumerate(data):
            _pillow_into(pixels, index, image, mode, size, where, bad)
    elif size is None:
        _jpegs_as_they_are(simplejpeg, data, pixels, mode, where, bad)
    else:
        for index, image in enumerate(data):
            if not _jpeg_resized(simplejpeg, image, pixels[index], mode, size):
                _pillow_into(pixels, index, image, mode, size, where, bad)


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


def _pillow_into(
    pixels: np.ndarray, index: int, image, mode: str, size, where: str, bad=None
) -> None:
    """Image ``index`` decoded by ``decode_image`` into its slot ``pixels[index]``; one
    that does not decode raised as a ``BadImage``, or with ``bad`` recorded there."""
    try:
        decoded = decode_image(image, mode, size)
    except ImportError:
        raise
    except Exception as e:
        error = _bad(index, e)
        if bad is None:
            raise error from e
        error.__cause__ = e
        bad[index] = error
        return
    array = decoded.permute(1, 2, 0).numpy()  # the [H, W, C] array decode_image made
    if array.shape != pixels.shape[1:]:
        raise _different(index, array.shape[0], array.shape[1], where)
    pixels[index] = array


def _jpegs_as_they_are(
    simplejpeg, data, pixels: np.ndarray, mode: str, where: str, bad=None
) -> None:
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
            _pillow_into(pixels, index, image, mode, None, where, bad)
            continue
        if h != height or w != width:
            raise _different(index, h, w, where)
        if space in _TO_PILLOW:
            _pillow_into(pixels, index, image, mode, None, where, bad)
            continue
        to_luma = gray and space != "Gray"  # a colour JPEG for "L": its RGB, converted later
        if to_luma and scratch is None:
            scratch = np.empty((len(slots), height, width, 3), dtype=np.uint8)
        buffer = scratch[len(colour)] if to_luma else slots[index]
        try:
            decode(image, "GRAY" if gray and not to_luma else "RGB", buffer=buffer)
        except Exception:
            _pillow_into(pixels, index, image, mode, None, where, bad)
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
