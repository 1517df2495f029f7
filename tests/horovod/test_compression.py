"""Horovod's compressors: floating-point tensors travel in half precision and come back in
their own dtype; other tensors travel as they are."""

import pytest
import torch

import spark_estimator.horovod as hvd


@pytest.mark.parametrize(
    "compressor, wire",
    [(hvd.Compression.fp16, torch.float16), (hvd.Compression.bf16, torch.bfloat16)],
)
def test_half_precision_compressors_round_trip(compressor, wire):
    tensor = torch.tensor([0.1, 1.5], dtype=torch.float64)
    sent, ctx = compressor.compress(tensor)
    assert sent.dtype == wire
    back = compressor.decompress(sent, ctx)
    assert back.dtype == torch.float64 and torch.allclose(back, tensor, atol=1e-2)
    ints = torch.tensor([1, 2])
    assert compressor.compress(ints)[0] is ints


def test_no_compression_sends_the_tensor_itself():
    tensor = torch.ones(2)
    sent, ctx = hvd.Compression.none.compress(tensor)
    assert sent is tensor and hvd.Compression.none.decompress(sent, ctx) is tensor
