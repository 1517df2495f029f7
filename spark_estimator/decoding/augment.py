"""Augmentation and resizing of an image ``[C, H, W]`` or of each image of a batch
``[B, C, H, W]``: ``center_crop``, ``random_crop``, ``random_flip`` (each row's draws from
its own generator), ``resize``."""

from __future__ import annotations

import torch

from .images import _pair


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
