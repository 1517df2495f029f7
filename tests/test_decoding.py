"""The decoding helpers a decode_fn uses: images from bytes and from Spark's image struct,
crops, flips and resizing; decode_images, a batch of encoded images into one buffer
(simplejpeg for JPEGs, and with simplejpeg hidden, Pillow for all), and the helpers on a
batch."""

import io
import pickle
import sys

import numpy as np
import pytest
import torch

from spark_estimator import decoding
from spark_estimator.decoding import (
    BadImage,
    center_crop,
    decode_image,
    decode_images,
    image_from_struct,
    image_sizes,
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


# -- decode_images: a batch into one buffer ----------------------------------------------------
def photo(height: int, width: int, seed: int = 0, channels: int = 3) -> np.ndarray:
    """A gradient with noise, so a JPEG of it has detail in every block."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 128 / (width + height)], -1)
    pixels = np.clip(base + rng.normal(0, 20, (height, width, 3)), 0, 255).astype(np.uint8)
    return pixels if channels == 3 else pixels[:, :, 0]


def jpeg(pixels: np.ndarray, **options) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", **options)
    return out.getvalue()


@pytest.fixture(params=["simplejpeg", "pillow"])
def jpeg_decoder(request, monkeypatch) -> str:
    """Each test twice: JPEGs decoded by simplejpeg, and with simplejpeg not importable
    (Pillow for everything)."""
    if request.param == "simplejpeg":
        pytest.importorskip("simplejpeg", reason="needs simplejpeg (the vision extra)")
    else:
        monkeypatch.setitem(sys.modules, "simplejpeg", None)  # its import raises ImportError
    return request.param


@pytest.fixture
def pillow_calls(monkeypatch) -> list[int]:
    """The images (their bytes) that decode_images gave to decode_image (Pillow)."""
    calls: list[int] = []
    original = decoding.decode_image

    def counted(data, *args, **kwargs):
        calls.append(data)
        return original(data, *args, **kwargs)

    monkeypatch.setattr(decoding.batch, "decode_image", counted)
    return calls


def jpegs_of_every_kind() -> list[bytes]:
    """Colour JPEGs of 4:4:4, 4:2:2 and 4:2:0 subsampling at qualities 50 to 100, a
    progressive one and grayscale ones, all 40x56."""
    images = [
        jpeg(photo(40, 56, seed), quality=quality, subsampling=subsampling)
        for seed, (quality, subsampling) in enumerate(
            [(50, 0), (75, 0), (100, 0), (50, 1), (90, 1), (60, 2), (90, 2), (95, 2)]
        )
    ]
    images.append(jpeg(photo(40, 56, 9), quality=85, progressive=True))
    images += [jpeg(photo(40, 56, s, channels=1), quality=q) for s, q in ((10, 50), (11, 95))]
    return images


def one_by_one(data: list[bytes], mode: str = "RGB", size=None) -> torch.Tensor:
    return torch.stack([decode_image(d, mode, size) for d in data])


@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_decode_images_gives_decode_images_pixels_for_every_kind_of_jpeg(
    jpeg_decoder, pillow_calls, mode
):
    data = jpegs_of_every_kind()
    # as they are; scaled by libjpeg to exactly size (1/2, 1/8); scaled (1/2, 1/8) then
    # resized; resized only; enlarged
    for size in (None, (20, 28), (5, 7), (16, 24), (4, 6), (30, 50), (60, 70)):
        pillow_calls.clear()
        batch = decode_images(data, mode=mode, size=size)
        assert batch.dtype == torch.uint8 and batch.shape[:2] == (len(data), len(mode))
        assert torch.equal(batch, one_by_one(data, mode, size)), (mode, size)
        assert len(pillow_calls) == (0 if jpeg_decoder == "simplejpeg" else len(data))
    assert decode_images(data, mode=mode).shape[2:] == (40, 56)


def test_the_batch_is_a_channels_last_view_of_one_buffer_or_of_out(jpeg_decoder):
    data = [jpeg(photo(24, 32, s)) for s in range(3)]
    batch = decode_images(data)
    assert batch.shape == (3, 3, 24, 32)
    assert batch.is_contiguous(memory_format=torch.channels_last)
    out = torch.zeros((3, 24, 32, 3), dtype=torch.uint8)
    into = decode_images(data, out=out)
    assert into.data_ptr() == out.data_ptr() and torch.equal(out.permute(0, 3, 1, 2), batch)
    resized = torch.zeros((3, 12, 16, 1), dtype=torch.uint8)
    assert torch.equal(decode_images(data, "L", (12, 16), out=resized)[:, 0], resized[..., 0])
    assert torch.equal(resized.permute(0, 3, 1, 2), one_by_one(data, "L", (12, 16)))
    bad_outs = {
        "uint8 tensor": torch.zeros((3, 24, 32, 3), dtype=torch.float32),
        "3 images of 3 channel": torch.zeros((3, 24, 32, 1), dtype=torch.uint8),
        "contiguous CPU": torch.zeros((3, 3, 24, 32), dtype=torch.uint8).permute(0, 2, 3, 1),
        "size=": torch.zeros((3, 24, 32, 3), dtype=torch.uint8),
    }
    for message, bad in bad_outs.items():
        with pytest.raises(ValueError, match=f"^out: .*{message}"):
            decode_images(data, size=(12, 16) if message == "size=" else None, out=bad)
    with pytest.raises(ValueError, match="^mode: 'RGB'"):
        decode_images(data, mode="RGBA")


def test_a_mixed_batch_decodes_each_image_into_its_slot(jpeg_decoder, pillow_calls):
    """JPEGs (colour, grayscale, CMYK), PNGs and a 16-bit PNG in one batch: each row is
    what decode_image gives; only the JPEGs simplejpeg takes skip Pillow."""
    sixteen = (np.arange(24 * 32).reshape(24, 32) * 80).astype(np.uint16)
    cmyk = io.BytesIO()
    Image.fromarray(photo(24, 32, 5)).convert("CMYK").save(cmyk, format="JPEG")
    data = [
        jpeg(photo(24, 32, 1)),
        encoded(photo(24, 32, 2)),
        jpeg(photo(24, 32, 3, channels=1)),
        encoded(sixteen),
        cmyk.getvalue(),
        encoded(photo(24, 32, 4, channels=1)),
    ]
    for mode in ("RGB", "L"):
        for size in (None, (12, 16), (20, 20)):
            pillow_calls.clear()
            assert torch.equal(decode_images(data, mode, size), one_by_one(data, mode, size))
            expected = [1, 3, 4, 5] if jpeg_decoder == "simplejpeg" else range(6)
            assert pillow_calls == [data[i] for i in expected]
    scaled = torch.from_numpy(((sixteen.astype(np.int64) + 128) // 257).astype(np.uint8))
    assert torch.equal(decode_images(data, "L")[3, 0], scaled)  # 16 bits scaled, as decode_image


def test_images_of_different_sizes_are_refused_naming_both_sizes(jpeg_decoder):
    for second in (jpeg(photo(20, 32)), encoded(photo(20, 32))):
        data = [jpeg(photo(24, 32)), jpeg(photo(24, 32, 1)), second]
        with pytest.raises(ValueError, match=r"different sizes .*24x32.* image 2 is 20x32.*size="):
            decode_images(data)
        out = torch.empty((3, 20, 32, 3), dtype=torch.uint8)
        with pytest.raises(ValueError, match=r"out holds 20x32, image 0 is 24x32.*decode_fn"):
            decode_images(data, out=out)
        assert decode_images(data, size=(16, 16)).shape == (3, 3, 16, 16)


def test_an_image_that_does_not_decode_is_named_by_its_index(jpeg_decoder):
    good = jpeg(photo(24, 32))
    for bad in (b"not an image", good[: len(good) // 2], b"", encoded(photo(24, 32))[:60]):
        for size in (None, (12, 16)):
            with pytest.raises(BadImage, match="^image 2 of the batch could not be decoded") as e:
                decode_images([good, good, bad, good], size=size)
            assert e.value.index == 2 and isinstance(e.value, ValueError)
            assert e.value.__cause__ is not None
    with pytest.raises(BadImage, match="^image 1 of the batch") as e:
        image_sizes([good, b"not an image"])
    assert e.value.index == 1
    again = pickle.loads(pickle.dumps(e.value))  # as a worker process sends it
    assert type(again) is BadImage and again.index == 1 and str(again) == str(e.value)
    with pytest.raises(BadImage) as e:  # the first image gives the buffer's size
        decode_images([b"not an image", good])
    assert e.value.index == 0


def test_image_sizes_reads_the_headers_of_jpegs_and_other_images(jpeg_decoder):
    data = [jpeg(photo(24, 32)), encoded(photo(17, 9)), jpeg(photo(5, 40, channels=1))]
    assert image_sizes(data) == [(24, 32), (17, 9), (5, 40)]
    assert image_sizes([]) == []


def test_an_empty_batch_is_empty(jpeg_decoder):
    assert decode_images([]).shape == (0, 3, 0, 0)
    assert decode_images([], mode="L", size=(8, 6)).shape == (0, 1, 8, 6)


# -- the helpers on a batch: each row as the image alone -------------------------------------
def generators(rows: int, seed: int = 7) -> list[np.random.Generator]:
    return [np.random.default_rng([seed, row]) for row in range(rows)]


@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
def test_batch_crops_and_flips_equal_each_row_alone_with_its_generator(layout):
    pixels = torch.randint(0, 256, (12, 20, 26, 3), dtype=torch.uint8)
    batch = pixels.permute(0, 3, 1, 2)  # what decode_images gives
    if layout == "contiguous":
        batch = batch.contiguous()
    for padding in (0, 3):
        rows = generators(12)
        crops = random_crop(batch, (16, 18), rows, padding=padding)
        flips = random_flip(crops, rows, p=0.5)
        alone = generators(12)
        expected = [
            random_flip(random_crop(image, (16, 18), g, padding=padding), g, p=0.5)
            for image, g in zip(batch, alone)
        ]
        assert flips.shape == (12, 3, 16, 18) and torch.equal(flips, torch.stack(expected))
        assert len({tuple(c.flatten().tolist()) for c in crops}) == 12  # crops differ
        assert [g.random() for g in rows] == [g.random() for g in alone]  # same draws made
        if layout == "channels_last":
            assert flips.is_contiguous(memory_format=torch.channels_last)
    flipped = random_flip(batch, generators(12, seed=1))
    assert 0 < sum(not torch.equal(a, b) for a, b in zip(flipped, batch)) < 12
    assert torch.equal(center_crop(batch, 8), torch.stack([center_crop(i, 8) for i in batch]))
    assert torch.equal(
        resize(batch, (9, 11)), torch.stack([resize(image, (9, 11)) for image in batch])
    )


def test_a_batch_takes_one_generator_per_row():
    batch = torch.zeros((4, 3, 8, 8), dtype=torch.uint8)
    with pytest.raises(ValueError, match="^augment: a batch of 4 images takes a list of 4"):
        random_crop(batch, 4, np.random.default_rng(0))
    with pytest.raises(ValueError, match="got a list of 3"):
        random_flip(batch, generators(3))
    with pytest.raises(ValueError, match=r"^augment: an image \[C, H, W\] takes one"):
        random_flip(batch[0], generators(1))
    with pytest.raises(ValueError, match=r"^image: \[C, H, W\] or a batch"):
        random_crop(batch[None], 4, generators(1))
    with pytest.raises(ValueError, match="smaller than the crop 9x9"):
        random_crop(batch, 9, generators(4))
    assert random_crop(batch[:0], 4, []).shape == (0, 3, 4, 4)
    assert random_flip(batch[:0], []).shape == (0, 3, 8, 8)


def test_a_flipped_image_keeps_its_channels_innermost_where_they_were():
    pixels = torch.randint(0, 256, (6, 8, 3), dtype=torch.uint8)
    image = pixels.permute(2, 0, 1)[:, 1:5, 2:7]  # a crop of decode_image's kind of tensor
    flipped = [random_flip(image, np.random.default_rng(s), p=1.0) for s in range(2)]
    for out in flipped + [random_flip(image.contiguous(), np.random.default_rng(0), p=1.0)]:
        assert torch.equal(out, image.flip(-1))
    assert flipped[0].stride(0) == 1  # each pixel's channels side by side, as in image
    assert random_flip(image, np.random.default_rng(0), p=0.0) is image
