"""Image classifier: a small CNN on a folder of JPEG and PNG files, read with Spark's
binaryFile source, with random crops and flips as augmentation.

Run it with either of:
    PYSPARK_PYTHON=.venv/bin/python .venv/bin/spark-submit --master "local[2]" \
        examples/image_classifier.py
    .venv/bin/python examples/image_classifier.py

It first draws 900 pictures of three shapes (circle, square, triangle) with Pillow, in
random colours, sizes and places, into one folder per class (two in three as JPEG, the
rest as PNG): nothing is downloaded. Spark reads the files' bytes with
spark.read.format("binaryFile") and each file's label is its folder's name. A decode_fn
decodes each image with Pillow (resized to 36x36) and augments the training rows with a
random 32x32 crop and a random left-right flip; validation and transform take the middle
32x32. Prints the per-epoch history and the held-out accuracy of model.transform, scored
by Spark ML's MulticlassClassificationEvaluator.
Needs Pillow, which ./dev.sh demo does not install: from the repository root,
.venv/bin/pip install -e '.[vision]' (./dev.sh test installs it too).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from torch import nn

try:
    from PIL import Image, ImageDraw
except ImportError:
    sys.exit("image_classifier.py needs Pillow: .venv/bin/pip install -e '.[vision]'")

from spark_estimator import Store, TorchEstimator
from spark_estimator.decoding import center_crop, decode_image, random_crop, random_flip

CLASSES = ["circle", "square", "triangle"]  # a label is its class's position here


def draw_shape(shape: str, rng: np.random.Generator, size: int = 48) -> Image.Image:
    """One ``size`` x ``size`` picture: a shape of random colour, size and place on a
    dark background sprinkled with noise."""
    noise = rng.integers(0, 60, (size, size, 3), dtype=np.uint8)
    image = Image.fromarray(noise + rng.integers(0, 60, 3, dtype=np.uint8))
    r = int(rng.integers(8, 16))  # the shape's half-width
    x, y = (int(v) for v in rng.integers(r + 2, size - r - 2, 2))
    colour = tuple(int(v) for v in rng.integers(120, 256, 3))
    draw = ImageDraw.Draw(image)
    if shape == "circle":
        draw.ellipse([x - r, y - r, x + r, y + r], fill=colour)
    elif shape == "square":
        draw.rectangle([x - r, y - r, x + r, y + r], fill=colour)
    else:
        draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=colour)
    return image


def write_shape_images(folder: str, per_class: int = 300, seed: int = 0) -> str:
    """``per_class`` pictures of each class in ``folder/<class>/``, two in three as JPEG,
    the others as PNG; the same files for the same seed. Returns ``folder``."""
    rng = np.random.default_rng(seed)
    for shape in CLASSES:
        os.makedirs(os.path.join(folder, shape), exist_ok=True)
        for i in range(per_class):
            image = draw_shape(shape, rng)
            if i % 3 == 2:
                image.save(os.path.join(folder, shape, f"{i:04d}.png"))
            else:
                image.save(os.path.join(folder, shape, f"{i:04d}.jpg"), quality=90)
    return folder


def images_frame(spark: SparkSession, folder: str):
    """The image files under ``folder`` as rows (path, modificationTime, length, content)
    with their class index as ``label``, taken from the folder name in the path."""
    files = (
        spark.read.format("binaryFile")
        .option("pathGlobFilter", "*.{jpg,png}")
        .option("recursiveFileLookup", "true")
        .load(folder)
    )
    folder_name = F.regexp_extract("path", r"([^/]+)/[^/]+$", 1)
    classes = F.array(*[F.lit(c) for c in CLASSES])
    return files.withColumn("label", (F.array_position(classes, folder_name) - 1).cast("int"))


def decode(row: dict, augment) -> dict:
    """A row's image bytes as a uint8 tensor [3, 32, 32]. ``augment`` is a seeded NumPy
    generator for training rows (a random crop and flip), None for validation and
    transform (the middle crop)."""
    image = decode_image(row["content"], size=(36, 36))  # Pillow: JPEG or PNG, resized
    if augment is None:
        return {"content": center_crop(image, 32)}
    return {"content": random_flip(random_crop(image, 32, augment), augment)}


class ShapesCNN(nn.Module):
    """Three 3x3 convolutions with max-pooling, averaged over the image, to class logits."""

    def __init__(self, classes: int = len(CLASSES)):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 16 x 16 x 16
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 32 x 8 x 8
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveMaxPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(64, classes)

    def forward(self, images):  # uint8 [B, 3, 32, 32], as decode() returns them
        return self.head(self.features(images.float() / 255))


def spark_session(app_name: str) -> SparkSession:
    builder = SparkSession.builder.appName(app_name).config("spark.ui.showConsoleProgress", "false")
    # Under spark-submit the master comes from its --master or properties file; run as a
    # plain Python script, this picks one.
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        builder = builder.master(os.environ.get("SPARK_MASTER", "local[2]"))
    return builder.getOrCreate()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    tmp = tempfile.gettempdir()
    parser.add_argument(
        "--store",
        default=os.path.join(tmp, "spark-estimator-images"),
        help="store folder (default: %(default)s)",
    )
    parser.add_argument(
        "--images",
        default=os.path.join(tmp, "spark-estimator-shapes"),
        help="folder of the generated images, written unless there (default: %(default)s)",
    )
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--num-proc", type=int, default=2)
    args = parser.parse_args(argv)

    if not any(Path(args.images).glob("*/*.png")):
        write_shape_images(args.images)
    # Executors must run the same Python as this driver (and find torch and Pillow in it).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = spark_session("spark-estimator image classifier")
    spark.sparkContext.setLogLevel("ERROR")

    train, test = images_frame(spark, os.path.abspath(args.images)).randomSplit([0.8, 0.2], seed=7)
    torch.manual_seed(0)
    net = ShapesCNN()
    estimator = TorchEstimator(
        model=net,
        optimizer=torch.optim.Adam(net.parameters(), lr=3e-3),
        loss=nn.CrossEntropyLoss(),
        feature_cols=["content"],  # the encoded bytes, decoded by decode() on the executors
        label_cols=["label"],
        decode_fn=decode,
        classification=True,  # transform adds prediction, probability and rawPrediction
        metrics={"accuracy": lambda logits, label: (logits.argmax(1) == label).float().mean()},
        batch_size=32,
        epochs=args.epochs,
        num_proc=args.num_proc,
        validation=0.2,
        random_seed=42,  # also seeds each row's crop and flip, per epoch
        store=Store.create(args.store),
    )
    model = estimator.fit(train)

    print(f"\n{'epoch':>5} {'train loss':>11} {'val loss':>9} {'val accuracy':>13}")
    for record in model.getHistory():
        val = record["validation"]
        print(
            f"{record['epoch']:>5} {record['train']['loss']:>11.4f} {val['loss']:>9.4f} "
            f"{val['accuracy']:>13.3f}"
        )

    evaluator = MulticlassClassificationEvaluator(metricName="accuracy")  # label, prediction
    held_out = evaluator.evaluate(model.transform(test))
    print(f"\nheld-out accuracy: {held_out:.3f} on {test.count()} images (chance: 0.333)")
    spark.stop()
    return 0 if held_out >= 0.8 else 1


if __name__ == "__main__":
    sys.exit(main())
