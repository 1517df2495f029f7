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

from .augment import center_crop, random_crop, random_flip, resize
from .batch import BadImage, decode_images, image_sizes
from .defaults import default_decode
from .images import decode_image, image_from_struct

__all__ = [
    "BadImage",
    "center_crop",
    "decode_image",
    "decode_images",
    "default_decode",
    "image_from_struct",
    "image_sizes",
    "random_crop",
    "random_flip",
    "resize",
]
