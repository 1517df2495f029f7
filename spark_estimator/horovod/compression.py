"""Executor: Horovod's gradient compressors: a tensor is cast to a smaller dtype before it
travels and back to its own dtype after (``compress`` -> (tensor, ctx), ``decompress``)."""

from __future__ import annotations

import torch


class Compressor:
    """Casts floating-point tensors to ``dtype`` for the network; others travel as they are."""

    dtype: torch.dtype | None = None

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        """The tensor to send and the context ``decompress`` needs (the original dtype)."""
        if cls.dtype is None or not tensor.is_floating_point():
            return tensor, tensor.dtype
        return tensor.to(cls.dtype), tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: torch.dtype) -> torch.Tensor:
        """``tensor`` back in the dtype ``compress`` recorded."""
        return tensor if tensor.dtype == ctx else tensor.to(ctx)


class NoneCompressor(Compressor):
    """No compression."""


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16."""

    dtype = torch.float16


class BF16Compressor(Compressor):
    """Floating-point tensors travel as bfloat16 (float32's range, fewer digits)."""

    dtype = torch.bfloat16


class Compression:
    """The compressors by name: ``Compression.none``, ``.fp16``, ``.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
