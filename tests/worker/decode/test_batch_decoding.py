"""The default decoding of a batch of encoded images (no decode_fn): into the memory a
worker's slot gives, its rows split over the rank's threads, a bad image costing its own
decoding attempts only."""

import io
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from spark_estimator.decoding import batch as batch_images
from spark_estimator.decoding import decode_images
from spark_estimator.shared.spec import ColumnSpec, DecodeSpec
from spark_estimator.worker.decode import batch_decoding
from spark_estimator.worker.decode.batch_decoding import BatchDecoding
from spark_estimator.worker.decode.decoded import BadRow, Recipe

Image = pytest.importorskip("PIL.Image", reason="needs Pillow (the vision extra)")
simplejpeg = pytest.importorskip("simplejpeg", reason="needs simplejpeg (the vision extra)")


def jpeg(value: int, size: int = 8) -> bytes:
    pixels = np.full((size, size, 3), value * 20 % 256, np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=95)
    return out.getvalue()


def decoding(bad_rows: str = "skip") -> BatchDecoding:
    column = ColumnSpec("img", "binary", "float32")
    return BatchDecoding(Recipe(DecodeSpec(bad_rows=bad_rows), (column,), frozenset(), 0, "path"))


def decode(decoder: BatchDecoding, images: list[bytes], pool=None):
    values = {"img": np.array(images, dtype=object)}
    names = np.array([f"file:/{i}.jpg" for i in range(len(images))], dtype=object)
    return decoder.decode(values, np.arange(len(images)), names, None, pool)


def test_a_bad_image_costs_its_own_decoding_not_another_of_its_batch(monkeypatch):
    decoded, pillow = [], []
    real_decode, real_image = simplejpeg.decode_jpeg, batch_images.decode_image

    class Counting:  # simplejpeg, its decodes counted
        decode_jpeg_header = staticmethod(simplejpeg.decode_jpeg_header)

        @staticmethod
        def decode_jpeg(data, *args, **kwargs):
            decoded.append(bytes(data))
            return real_decode(data, *args, **kwargs)

    def counted_image(data, *args, **kwargs):
        pillow.append(bytes(data))
        return real_image(data, *args, **kwargs)

    monkeypatch.setattr(batch_images, "_simplejpeg", lambda: Counting)
    monkeypatch.setattr(batch_images, "decode_image", counted_image)
    images = [jpeg(i) for i in range(8)]
    images[3] = b"not an image"
    result = decode(decoding(), images)
    kept = [0, 1, 2, 4, 5, 6, 7]
    assert result.kept.tolist() == kept and result.skipped == [(True, 3)]
    assert sorted(decoded) == sorted(images[i] for i in kept)  # each good image once
    assert pillow == [b"not an image"]  # the bad one: Pillow's try, once
    monkeypatch.undo()
    assert torch.equal(result.decoded["img"], decode_images([images[i] for i in kept]))
    with pytest.raises(BadRow, match=r"row 3 of the split \(path file:/3.jpg\)"):
        decode(decoding("fail"), images)


def test_the_default_image_decoding_splits_a_batch_over_the_threads(monkeypatch):
    spans = []
    real = batch_decoding.decode_images_into

    def recorded(data, out, *args, **kwargs):
        spans.append((threading.current_thread().name, len(data)))
        return real(data, out, *args, **kwargs)

    monkeypatch.setattr(batch_decoding, "decode_images_into", recorded)
    images = [jpeg(i) for i in range(64)]
    with ThreadPoolExecutor(2, thread_name_prefix="decode") as pool:
        result = decode(decoding(), images, pool)
    assert sorted(n for _, n in spans) == [32, 32]
    assert all(thread.startswith("decode") for thread, _ in spans)  # the pool's threads
    assert torch.equal(result.decoded["img"], decode_images(images))


def test_the_default_image_decoding_decodes_into_the_memory_allocate_gives():
    images = [jpeg(i) for i in range(6)]
    images[2] = b"not an image"
    room = torch.zeros(6 * 8 * 8 * 3, dtype=torch.uint8)
    asked = []
    decoder = decoding()

    def allocate(shape, dtype):
        asked.append((shape, dtype))
        return room[: int(np.prod(shape))].view(shape)

    decoder.allocate = allocate
    result = decode(decoder, images)
    batch = result.decoded["img"]
    assert asked == [((6, 8, 8, 3), torch.uint8)]  # [B, H, W, C]: the pixels of the batch
    assert batch.data_ptr() == room.data_ptr()  # decoded there, the bad row's place reused
    assert batch.is_contiguous(memory_format=torch.channels_last)
    kept = [0, 1, 3, 4, 5]
    assert result.kept.tolist() == kept
    assert torch.equal(batch, decode_images([images[i] for i in kept]))
