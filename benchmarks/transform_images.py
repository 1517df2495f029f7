"""Rows/s of ``TorchModel.transform`` on encoded JPEGs, decoded in threads or in worker
processes (``decode_pool``), against the same transform of the code before them.

A hand-run benchmark, not a test (issue 44, item 5). The data: ``--images`` (4,096) encoded
128x128 JPEGs of ``image_fit.make_image``, read with ``spark.read.format("binaryFile")``
into ``--partitions`` (8) partitions on ``local[2]``. The model: ``image_fit``'s small CNN
(untrained; transform's cost does not depend on the weights) in a ``TorchModel`` with
``feature_cols=["content"]``, decoding each row either with ``image_fit.decode`` as a
``decode_fn`` (Pillow, the centre crop: no augmentation in transform) or with the default
decoding (no ``decode_fn``). Timed: ``transform(df).write.format("noop").save()``, the
best of ``--repeats`` after one untimed run (which starts Spark's Python workers and, with
processes, their decode workers, kept for the next runs).

Run it twice to compare with the code before this issue: as it is, and with that code
first on ``PYTHONPATH`` (Spark's Python workers inherit it), e.g. a worktree of the
commit before::

    git worktree add /tmp/before a81f691
    PYTHONPATH=/tmp/before .venv/bin/python benchmarks/transform_images.py --label before
    .venv/bin/python benchmarks/transform_images.py --label after

The code before has no ``decode_pool``: it decodes in threads only. Each run records its
section (by ``--label``) in ``benchmarks/results/transform_images.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402
import image_fit  # noqa: E402

import spark_estimator  # noqa: E402
from spark_estimator import TorchModel  # noqa: E402
from spark_estimator.decoding import decode_image  # noqa: E402

bc.by_value(image_fit)

FULL_IMAGES = 4096
HEADER = """\
# Transform on images (benchmarks/transform_images.py)

Rows/s of `TorchModel.transform` on 128x128 JPEGs read with `binaryFile` (`local[2]`, 8
partitions, a small CNN), decoded by a Pillow `decode_fn` or by the default decoding, in
threads or in worker processes (`decode_pool`); one section per code (`--label`): the code
before issue 44 decodes in threads only (its section's `Code` line names the checkout that
ran the script; the line below it says where spark_estimator came from: the commit before,
installed in its own environment). See the script's docstring.

On the 2-core test machine (2 tasks of 1 CPU, so 1 decode worker a task with processes)
transform runs as fast as before, within the machine's noise of about 10%: processes do
not pay on tasks of 1 or 2 CPUs, which is why threads are the default there; they are for
executors whose tasks get many cores.

    .venv/bin/python benchmarks/transform_images.py --label after
"""


def centre(row: dict, augment) -> dict:
    """Pillow's decoding and the centre crop, as ``image_fit.decode`` without augmentation."""
    image = decode_image(row["content"])
    top = (image_fit.SIZE - image_fit.CROP) // 2
    crop = image_fit.CROP
    return {"content": image[:, top : top + crop, top : top + crop]}


def rows_per_second(model, df, images: int, repeats: int) -> float:
    model.transform(df).write.format("noop").mode("overwrite").save()  # untimed
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        model.transform(df).write.format("noop").mode("overwrite").save()
        best = max(best, images / (time.perf_counter() - start))
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--label", default="after", help="the section's name (the code's)")
    bc.add_pass_args(parser)
    args = parser.parse_args()
    images, repeats = bc.pass_sizes(args, FULL_IMAGES)
    env = bc.machine(("PIL",))
    folder = image_fit.image_folder(images, bc.DATA)
    spark = bc.spark_session("local[2]")
    df = spark.read.format("binaryFile").load(str(folder / "class_*")).repartition(args.partitions)
    df = df.select("path", "content").cache()
    df.count()
    pools = ["threads", "processes"] if TorchModel().hasParam("decode_pool") else [None]
    rates = {}
    for name, fn in (("decode_fn", centre), ("default", None)):
        for pool in pools:
            params = {"decode_pool": pool} if pool else {}
            if fn is not None:
                params["decode_fn"] = fn
            net = image_fit.build("small").eval()  # global pooling: 112 or 128 pixels alike
            model = TorchModel(model=net, feature_cols=["content"], **params)
            bc.wait_quiet(args.quiet_timeout)
            rates[name, pool or "threads"] = rows_per_second(model, df, images, repeats)
            print(f"{name:9s} {pool or 'threads':9s}: {rates[name, pool or 'threads']:,.0f} rows/s")
    lines = [
        f"## {args.label}: {env['date']}, stack `{env['venv']}`",
        "",
        *bc.machine_lines(env, ("PIL",)),
        f"- spark_estimator from `{Path(spark_estimator.__file__).parent}`",
        f"- Job: {images:,} JPEGs 128x128, {args.partitions} partitions on `local[2]`, "
        f"best of {repeats} after an untimed run",
        "",
        "| decoding | pool | rows/s |",
        "|---|---|---:|",
    ]
    lines += [f"| {name} | {pool} | {rate:,.0f} |" for (name, pool), rate in rates.items()]
    section = "\n".join(lines) + "\n"
    print(section)
    bc.record(args, "transform_images", HEADER, section, args.label, images == FULL_IMAGES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
