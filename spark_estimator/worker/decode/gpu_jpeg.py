"""Executor: ``decode_device="cuda"``: the binary columns' JPEGs decoded on the rank's GPU.

The rows' decoding on the CPU (threads or worker processes) leaves these columns as they
are; the rank keeps each batch's bytes of them (``GpuJpegs.keep_bytes``) and, once the batch
is on its way to the device, decodes each column there in one call (``decode_jpegs``:
torchvision's ``decode_jpeg``, nvJPEG). With a ``decode_batch_fn`` the whole batch waits for
the GPU: the function then runs on the rank, after the images are decoded there
(``GpuJpegs.decode``). Not with a ``collate_fn``, which takes the rows' decoded values.
"""

from __future__ import annotations

import torch

from ...shared.packages import require_gpu_jpeg
from ...shared.spec import ColumnSpec, DecodeSpec
from .batch_decoding import BatchDecoding
from .decoded import Decoded


class GpuJpegs:
    """The GPU's part of decoding ``variable`` columns under ``spec`` (see the module)."""

    def __init__(self, spec: DecodeSpec, variable: tuple[ColumnSpec, ...], whole: BatchDecoding):
        gpu = spec.device == "cuda" and whole.collate_fn is None
        self.images = [c.name for c in variable if gpu and c.kind == "binary"]
        # with decode_batch_fn too, the whole batch is decoded on the rank, after the GPU's part
        self.whole = gpu and whole.batch_fn is not None
        self.variable = variable

    def cpu_columns(self) -> tuple[ColumnSpec, ...]:
        """The columns decoded on the CPU, before the GPU's part."""
        if self.whole:
            return ()
        return tuple(c for c in self.variable if c.name not in self.images)

    def keep_bytes(self, decoded: Decoded, batch, kept, ids, names) -> None:
        """The rows' bytes of the columns the GPU decodes put in ``decoded`` (the rows
        ``kept``: None, all), and with ``decode_batch_fn`` their indices and names."""
        raw = self.variable if self.whole else [c for c in self.variable if c.name in self.images]
        for c in raw:
            values = batch[c.name]
            decoded.columns[c.name] = list(values if kept is None else values[kept])
        if self.whole:
            if kept is not None:
                ids, names = ids[kept], names[kept] if names is not None else None
            decoded.rows_of = (ids, names)

    def decode(
        self, decoded: Decoded, device: torch.device, epoch: int | None, local: BatchDecoding
    ) -> list[int]:
        """The kept bytes decoded on ``device`` in one call per column; then, with
        ``decode_batch_fn``, the batch through it (``local``'s). The padding it counted."""
        for name in self.images:
            if isinstance(decoded.columns.get(name), list):
                decoded.columns[name] = decode_jpegs(name, decoded.columns[name], device)
        if not self.whole:
            return [0, 0]
        ids, names = decoded.rows_of
        result = local.decode_batch(decoded.columns, ids, names, epoch)
        decoded.columns, decoded.masks = result.decoded.columns, result.decoded.masks
        return result.padding


def decode_jpegs(name: str, images: list[bytes], device: torch.device) -> torch.Tensor:
    """JPEG images decoded on ``device`` (a GPU) in one batch by torchvision's
    ``decode_jpeg``, as uint8 ``[rows, 3, H, W]`` (RGB)."""
    decode_jpeg, ImageReadMode = require_gpu_jpeg()
    if not images:
        return torch.empty((0, 3, 0, 0), dtype=torch.uint8, device=device)
    joined = torch.frombuffer(bytearray().join(images), dtype=torch.uint8)  # one copy
    data = list(joined.split([len(b) for b in images]))
    out = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    shapes = sorted({tuple(t.shape) for t in out})
    if len(shapes) > 1:
        a, b = shapes[:2]
        raise ValueError(
            f"feature_cols: column '{name}' has images of different sizes in one batch "
            f"({'x'.join(map(str, a))} and {'x'.join(map(str, b))}); decode_device='cuda' "
            "stacks them as they are: resize them to one size before fit"
        )
    return torch.stack(out)
