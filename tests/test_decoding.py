"""The decoding helpers a decode_fn uses: images from bytes and from Spark's image struct,
crops, flips and resizing."""

import io

import numpy as np
import pytest
import torch

from spark_estimator.decoding import (
    center_crop,
    decode_image,
    image_from_struct,
    random_crop,
    random_flip,
    resize,
)

Image = pytest.importorskip("PIL.Image", reason="needs Pillow (the vision extra)")


def encoded(pixels: np.ndarray, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def test_encoded_images_decode_to_uint8_chw_in_the_mode_asked():
    gray = np.arange(12, dtype=np.uint8).reshape(3, 4)
    assert decode_image(encoded(gray), mode="L").tolist() == [gray.tolist()]
    rgb = decode_image(encoded(gray))
    assert rgb.shape == (3, 3, 4) and rgb.dtype == torch.uint8
    assert torch.equal(rgb[0], rgb[2])
    photo = np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8)
    small = decode_image(encoded(photo, "JPEG"), size=(16, 24))
    assert small.shape == (3, 16, 24)
    with pytest.raises(Exception, match="cannot identify image"):
        decode_image(b"not an image")


def test_spark_image_structs_decode_from_bgr_to_rgb():
    bgr = np.array([[[10, 20, 30], [40, 50, 60]]], dtype=np.uint8)  # 1 x 2, BGR
    struct = {"origin": "x", "height": 1, "width": 2, "nChannels": 3, "mode": 16}
    image = image_from_struct({**struct, "data": bgr.tobytes()})
    assert image.tolist() == [[[30, 60]], [[20, 50]], [[10, 40]]]
    gray = {**struct, "nChannels": 1, "mode": 0, "data": bytes([7, 9])}
    assert image_from_struct(gray).tolist() == [[[7, 9]]]
    with pytest.raises(ValueError, match="image mode 5 with 3 channels"):
        image_from_struct({**struct, "mode": 5, "data": bgr.tobytes()})


def test_crops_and_flips_draw_from_the_generator_given():
    image = torch.arange(2 * 6 * 8, dtype=torch.uint8).reshape(2, 6, 8)
    assert center_crop(image, 4).shape == (2, 4, 4)
    assert torch.equal(center_crop(image, (2, 4)), image[:, 2:4, 2:6])
    crops = [random_crop(image, 4, np.random.default_rng(s), padding=1) for s in range(6)]
    assert all(c.shape == (2, 4, 4) for c in crops)
    assert len({tuple(c.flatten().tolist()) for c in crops}) > 1
    again = random_crop(image, 4, np.random.default_rng(3), padding=1)
    assert torch.equal(again, crops[3])
    flips = {
        random_flip(image, np.random.default_rng(s)).tolist() == image.flip(-1).tolist()
        for s in range(8)
    }
    assert flips == {True, False}
    with pytest.raises(ValueError, match="smaller than the crop 7x7"):
        random_crop(image, 7, np.random.default_rng(0))


def test_resize_keeps_the_dtype():
    image = torch.full((3, 8, 8), 100, dtype=torch.uint8)
    out = resize(image, (4, 6))
    assert out.shape == (3, 4, 6) and out.dtype == torch.uint8 and (out == 100).all()


def test_a_16_bit_grayscale_png_is_scaled_to_8_bits_keeping_its_range_or_given_whole():
    values = (np.arange(64 * 64).reshape(64, 64) * 16).astype(np.uint16)  # 0 .. 65520
    data = encoded(values)
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    scaled = torch.from_numpy(((values.astype(np.int64) + 128) // 257).astype(np.uint8))
    gray = decode_image(data, mode="L")
    assert gray.dtype == torch.uint8 and torch.equal(gray[0], scaled)
    rgb = decode_image(data)  # the default decoding: 3 equal channels, not saturated
    assert rgb.shape == (3, 64, 64) and all(torch.equal(c, scaled) for c in rgb)
    assert len(rgb.unique()) == 256
    assert decode_image(data, mode="L", size=(32, 32)).shape == (1, 32, 32)
    whole = decode_image(data, mode="L", depth=16)
    assert whole.dtype == torch.int32
    assert torch.equal(whole[0], torch.from_numpy(values.astype(np.int32)))
    assert decode_image(data, depth=16).shape == (3, 64, 64)
    eight = np.arange(12, dtype=np.uint8).reshape(3, 4)
    assert decode_image(encoded(eight), mode="L", depth=16).tolist() == [
        (eight.astype(np.int32) * 257).tolist()
    ]
    with pytest.raises(ValueError, match="^depth: 8"):
        decode_image(data, depth=12)
