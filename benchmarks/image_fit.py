"""Images/s of ``fit`` on encoded JPEGs against the decode limit and a hand DataLoader loop.

A hand-run benchmark, not a test. The job: ``--images`` (20,000) encoded 128x128 RGB JPEGs
(quality 90, 6-8 KB each) in 10 classes, generated once into a cache folder (one folder per
class, ``class_K/``, as ``torchvision.datasets.ImageFolder`` reads them: the label is the
folder): each a random two-colour gradient with 2-5 ellipses, rectangles or triangles
drawn with Pillow (their hue and kinds depend on the class) and Gaussian noise, so the
JPEGs are as large as photographs of that size. Training: decode (Pillow), a random 112x112
crop and a random horizontal flip (``spark_estimator.decoding``), a small CNN on the uint8
images (``x.float() / 255`` inside the model), cross-entropy, SGD (lr 0.05, momentum 0.9),
global batch 128, 2 epochs, CPU. Two models (``--models``):

- ``small``: the crop subsampled 4x (28x28), conv 3-16 and 16-32 (stride 2), a linear head:
  far cheaper than decoding, so decoding is the bottleneck;
- ``large``: conv 16-32-64-128 (stride 2 each) on the whole crop: about ten times
  decoding's cost per image, so computing is. No batch norm: its running statistics
  differ between DDP ranks after the last step, and the fit refuses ranks whose final
  weights (buffers included) differ.

Side by side in one run, for each model, each ``--repeats`` times:

(a) the decode limit (once, not per model): every image's bytes, read into memory first,
    decoded to a uint8 tensor ``[3, 128, 128]`` by ``decoding.decode_image`` (Pillow) in a
    pool of processes, one per core (``multiprocessing``, fork); images/s from the first
    image to the last, the pool already started, the best of 3 passes. Also the same on
    one core, the per-core rate (thousands per second for 128x128 JPEGs);
(b) the compute limit: the model trained in this process on batches already decoded and
    augmented, held in memory (a pool of 1,024 images cycled), with each of the hand
    loop's torch thread counts, the fastest: the most images/s the training could reach
    with free decoding. The regime is decode-bound where (a) < (b);
(c) the hand loop: one process, a ``Dataset`` reading each image's file and decoding it
    with the same function as the fit's ``decode_fn`` (same augmentation, seeded by
    (seed, epoch, image)), ``DataLoader(batch_size=128, shuffle=True, num_workers=cores,
    persistent_workers=True)``, the same model, epochs and optimizer, timed with each of
    ``--hand-threads`` torch threads in the training process (1 and cores; a DataLoader's
    workers run one each), the fastest being the baseline: the training process's threads
    share the cores with the workers' decoding, and torch's threads slow down a lot when
    another process takes one of their cores (on a busy machine 1 thread can be several
    times faster than 2). Timed from the first epoch's iterator (workers started) to the
    last step. Its data share: the seconds the loop waited in ``next()`` / its seconds;
(d) our first fit: ``spark.read.format("binaryFile")`` on the folder (``content``, the
    label from the path with ``regexp_extract``), ``TorchEstimator(feature_cols=["content"],
    label_cols=["label"], decode_fn=decode, num_proc=2, batch_size=64, use_gpu=False)`` on
    ``local[2]`` into a new, empty store, so the JPEG bytes are materialized first;
(e) a re-fit: the same estimator again on the same store, the dataset already
    materialized.

Also timed once: the library's fingerprint of the folder's files
(``driver.cache_key.source_fingerprint``), which every fit's materialization step computes
to find its dataset in the store, re-fits included; with one file per image it grows with
the images. The table's materialization column is ``TorchEstimator._materialize``'s
seconds (``bench_common.fit_phases``).

For (d) and (e): images/s of the training phase (images x epochs / the longest rank's
``seconds`` in ``runs/<run_id>/ranks.json``: from the end of the rank's setup to the end of
its loop) and of the whole fit (wall time of ``fit()``); the data share the progress bar
shows as ``data=`` (the history's per-epoch ``seconds``: the seconds the step waited for
its batch, summed over ranks and epochs, / the training seconds, likewise).

Targets (issue 37): the fit's training phase (re-fit, best run) >= 0.9x the hand loop's
images/s with both models; with the decode-bound model >= 0.8x the decode limit; the
``data=`` share reads decode-bound (>= 0.3) with the decode-bound model and compute-bound
(<= 0.1) with the other. Before the timed runs: one untimed fit of 256 images starts
Spark's Python workers, and the folder is read once (page cache). Before each timed run
the script waits (up to ``--quiet-timeout``) for other processes to leave the CPUs idle.
Results are printed and written to ``benchmarks/results/image_fit.md`` (a run smaller than
the full job to a temporary folder; ``--no-record`` writes nothing).

Run from the repository root::

    .venv/bin/python benchmarks/image_fit.py                      # ~15 min on 2 cores
    .venv/bin/python benchmarks/image_fit.py --quick --no-record  # ~2 min: 1,024 images
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from spark_estimator.decoding import decode_image, random_crop, random_flip  # noqa: E402

FULL_IMAGES, FULL_EPOCHS = 20_000, 2
SIZE, CROP, CLASSES = 128, 112, 10
GLOBAL_BATCH, LR, MOMENTUM = 128, 0.05, 0.9
MODELS = ("small", "large")
TARGET_HAND, TARGET_DECODE = 0.9, 0.8
DECODE_SHARE, COMPUTE_SHARE = 0.3, 0.1
HEADER = """\
# Image fit (benchmarks/image_fit.py)

Images/s of `TorchEstimator.fit` (2 processes x batch 64 on `local[2]`, CPU) on encoded
128x128 JPEGs read with `spark.read.format("binaryFile")`, decoded per row by a
`decode_fn` (Pillow, random 112x112 crop and flip) in the ranks, against: the decode limit
(the same bytes decoded by Pillow on every core, no training), the compute limit (the model
trained on images already decoded, in memory) and a hand-written loop (one process,
`DataLoader(num_workers=cores)` over the same files, same decoding and augmentation, model,
batch 128 and epochs). Two models: `small` (decoding is the bottleneck) and `large`
(computing is). Targets (issue 37): fit >= 0.9x the hand loop with both; with `small`
>= 0.8x the decode limit; the `data=` share tells the two regimes apart. See the script's
docstring for how each number is obtained.

The decode limit is Pillow's decoding alone, on every core. A fit shares those cores with
the rest of its data path (reading the Parquet, the shuffle, the crop and flip, the
per-row random generator, collating) and with the model's step, so its ceiling is lower:
each `small` row gives it ("data path alone": one rank's path without training, on one
core; "at most": that path and the model's step on every core), and how close the fit
comes to that ceiling.

    .venv/bin/python benchmarks/image_fit.py [--images N] [--epochs E] [--repeats R]
"""


# -- the images -------------------------------------------------------------------------------
def make_image(index: int, size: int = SIZE, classes: int = CLASSES) -> bytes:
    """Image ``index`` (class ``index % classes``) as JPEG bytes: a random two-colour
    gradient, 2-5 shapes whose hue and kinds depend on the class, Gaussian noise (sigma
    12)."""
    import colorsys

    from PIL import Image, ImageDraw

    rng = np.random.default_rng([bc.SEED, index])
    label = index % classes
    c0, c1 = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    t = np.linspace(0, 1, size, dtype=np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    g = np.cos(angle) * t[None, :] + np.sin(angle) * t[:, None]
    g = (g - g.min()) / (np.ptp(g) + 1e-6)
    pixels = c0 * (1 - g[..., None]) + c1 * g[..., None]
    image = Image.fromarray(pixels.astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for k in range(int(rng.integers(2, 6))):
        x0, y0 = (int(v) for v in rng.integers(0, size - 20, 2))
        w, h = (int(v) for v in rng.integers(12, size // 2, 2))
        hue = (label / classes + rng.normal(0, 0.02)) % 1
        rgb = colorsys.hsv_to_rgb(hue, rng.uniform(0.5, 1), rng.uniform(0.5, 1))
        colour = tuple(int(255 * v) for v in rgb)
        kind = (label + k * (1 + label % 2)) % 3
        if kind == 0:
            draw.ellipse([x0, y0, x0 + w, y0 + h], fill=colour)
        elif kind == 1:
            draw.rectangle([x0, y0, x0 + w, y0 + h], fill=colour)
        else:
            draw.polygon([(x0, y0 + h), (x0 + w // 2, y0), (x0 + w, y0 + h)], fill=colour)
    noisy = np.asarray(image, dtype=np.int16) + rng.normal(0, 12, (size, size, 3)).astype(np.int16)
    out = io.BytesIO()
    Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


def _write_images(job: tuple[str, int, int]) -> None:
    folder, start, stop = job
    for i in range(start, stop):
        path = Path(folder) / f"class_{i % CLASSES:02d}" / f"img_{i:06d}.jpg"
        path.write_bytes(make_image(i))


def image_folder(images: int, root: Path) -> Path:
    """The ``images`` JPEGs under ``root`` (``class_KK/img_NNNNNN.jpg``), written with one
    process per core unless already there; returns their folder."""
    folder = Path(root) / f"jpeg-{images}-{SIZE}px-seed-{bc.SEED}"
    done = folder / "_bench_done"
    if done.exists():
        return folder
    print(f"writing {images:,} JPEGs to {folder} ...", flush=True)
    for k in range(CLASSES):
        (folder / f"class_{k:02d}").mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, images, 4 * (os.cpu_count() or 1) + 1).astype(int)
    jobs = [(str(folder), int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
    with multiprocessing.get_context("fork").Pool(os.cpu_count()) as pool:
        pool.map(_write_images, jobs)
    done.write_text(str(images))
    return folder


def image_files(folder: Path) -> list[tuple[str, int]]:
    """(path, label) of every image, sorted by path; the label is the folder's number."""
    paths = sorted(folder.glob("class_*/*.jpg"))
    return [(str(p), int(p.parent.name.split("_")[1])) for p in paths]


# -- decoding and the models ------------------------------------------------------------------
def decode(row: dict, augment) -> dict:
    """The fit's ``decode_fn`` (and the hand loop's): the JPEG to uint8 ``[3, 128, 128]``,
    then a random 112x112 crop and flip (the centre crop without ``augment``)."""
    image = decode_image(row["content"])
    if augment is None:
        top = (SIZE - CROP) // 2
        return {"content": image[:, top : top + CROP, top : top + CROP]}
    return {"content": random_flip(random_crop(image, CROP, augment), augment)}


class Net(torch.nn.Module):
    """A CNN on uint8 images: ``x.float() / 255``, subsampled by ``stride``, 3x3 convs of
    stride 2 and ReLUs, global average pooling, a linear head to ``CLASSES`` logits."""

    def __init__(self, widths: tuple[int, ...], stride: int = 1):
        super().__init__()
        self.stride = stride
        layers, channels = [], 3
        for width in widths:
            layers.append(torch.nn.Conv2d(channels, width, 3, stride=2, padding=1))
            layers.append(torch.nn.ReLU(inplace=True))
            channels = width
        self.features = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(channels, CLASSES)

    def forward(self, x):
        if self.stride > 1:
            x = x[:, :, :: self.stride, :: self.stride]
        x = self.features(x.float().div_(255))
        return self.head(x.mean((2, 3)))


def build(name: str, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    if name == "small":
        return Net((16, 32), stride=4)
    if name == "large":
        return Net((16, 32, 64, 128))
    raise ValueError(f"model: {name!r} is not one of {MODELS}")


def optimizer(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)


# -- (a) the decode limit -----------------------------------------------------------------------
_BYTES: list[bytes] = []


def _decode_span(span: tuple[int, int]) -> int:
    start, stop = span
    for i in range(start, stop):
        decode_image(_BYTES[i])
    return stop - start


class DecodeLimit:
    """``decode_image`` over ``blobs`` in ``workers`` processes (forked with the bytes in
    memory, started and warmed once): ``rate()`` times one pass (each pass's rate kept in
    ``passes``). Kept open, its passes can be taken between other measurements, each
    paired with the one beside it in time."""

    def __init__(self, blobs: list[bytes], workers: int):
        global _BYTES
        _BYTES = blobs
        bounds = np.linspace(0, len(blobs), 8 * workers + 1).astype(int)
        self.spans = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        self.pool = multiprocessing.get_context("fork").Pool(workers)
        self.pool.map(_decode_span, [(0, 1)] * workers)
        _BYTES = []  # the forked workers hold their copy
        self.passes: list[float] = []

    def rate(self) -> float:
        """Images/s of one pass over the images."""
        start = time.perf_counter()
        done = sum(self.pool.map(_decode_span, self.spans, chunksize=1))
        self.passes.append(done / (time.perf_counter() - start))
        return self.passes[-1]

    def close(self) -> None:
        self.pool.terminate()
        self.pool.join()


def decode_limit(blobs: list[bytes], workers: int, passes: int = 3) -> float:
    """Images/s of ``decode_image`` over ``blobs`` in ``workers`` processes (``DecodeLimit``),
    the best of ``passes`` passes."""
    limit = DecodeLimit(blobs, workers)
    try:
        return max(limit.rate() for _ in range(passes))
    finally:
        limit.close()


# -- (b) the compute limit ----------------------------------------------------------------------
def compute_limit(name: str, blobs: list[bytes], labels: list[int], steps: int) -> float:
    """Images/s of ``steps`` training steps of model ``name`` in this process on batches of
    ``GLOBAL_BATCH`` images decoded and augmented beforehand (1,024 images, cycled)."""
    count = min(len(blobs), 1024)
    rng = np.random.default_rng(bc.SEED)
    images = torch.stack([decode({"content": blobs[i]}, rng)["content"] for i in range(count)])
    targets = torch.tensor(labels[:count])
    net = build(name).train()
    opt = optimizer(net)
    loss_fn = torch.nn.CrossEntropyLoss()
    order = torch.randperm(count, generator=torch.Generator().manual_seed(0))
    index = [order[(i * GLOBAL_BATCH) % count :][:GLOBAL_BATCH] for i in range(steps + 2)]
    start = None
    for i, rows in enumerate(index):
        if i == 2:  # two warm-up steps
            start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(net(images[rows]), targets[rows]).backward()
        opt.step()
    return sum(len(rows) for rows in index[2:]) / (time.perf_counter() - start)


# -- (c) the hand loop ----------------------------------------------------------------------------
class ImageFiles(torch.utils.data.Dataset):
    """The images as an ImageFolder would read them: ``(epoch, i)`` -> (the image read from
    its file and decoded by ``decode`` with a generator seeded by (seed, epoch, i), label)."""

    def __init__(self, files: list[tuple[str, int]], seed: int = 0):
        self.files, self.seed = files, seed

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, key: tuple[int, int]):
        epoch, i = key
        path, label = self.files[i]
        with open(path, "rb") as f:
            data = f.read()
        augment = np.random.default_rng([self.seed, epoch, i])
        return decode({"content": data}, augment)["content"], label


class EpochShuffle(torch.utils.data.Sampler):
    """A new permutation each epoch, yielding (epoch, index): the epoch reaches the
    persistent workers with each index."""

    def __init__(self, size: int, seed: int = 0):
        self.size, self.epoch = size, 0
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        epoch = self.epoch
        self.epoch += 1
        return ((epoch, int(i)) for i in torch.randperm(self.size, generator=self.generator))


def train_pass(
    loader, net, opt, loss_fn, device: torch.device | None = None
) -> tuple[float, list[torch.Tensor]]:
    """One pass of a hand loop over ``loader`` (its batches moved to ``device``, where
    given): the seconds it waited for its batches, and each step's loss."""
    waited, losses = 0.0, []
    batches = iter(loader)
    while True:
        before = time.perf_counter()
        try:
            x, y = next(batches)
        except StopIteration:
            break
        waited += time.perf_counter() - before
        if device is not None:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return waited, losses


def hand_loop(name: str, files: list[tuple[str, int]], epochs: int, workers: int) -> dict:
    """The hand-written loop (c): seconds, images/s, the share spent waiting for batches,
    the mean loss of its last epoch."""
    net = build(name).train()
    opt = optimizer(net)
    loss_fn = torch.nn.CrossEntropyLoss()
    loader = torch.utils.data.DataLoader(
        ImageFiles(files),
        batch_size=GLOBAL_BATCH,
        sampler=EpochShuffle(len(files)),
        num_workers=workers,
        persistent_workers=workers > 0,
        multiprocessing_context="fork" if workers > 0 else None,
    )
    waited, losses = 0.0, []
    start = time.perf_counter()
    for _ in range(epochs):
        pass_waited, losses = train_pass(loader, net, opt, loss_fn)
        waited += pass_waited
    seconds = time.perf_counter() - start
    del loader  # stops the workers
    return {
        "seconds": seconds,
        "rate": len(files) * epochs / seconds,
        "data_share": waited / seconds,
        "loss": float(torch.stack(losses).mean()),
    }


# -- (d), (e) our fit -----------------------------------------------------------------------------
def frame(spark, folder: Path):
    """The images as ``binaryFile`` reads them, with ``label`` from the path's class folder."""
    from pyspark.sql import functions as F

    df = (
        spark.read.format("binaryFile")
        .option("pathGlobFilter", "*.jpg")
        .option("recursiveFileLookup", "true")
        .load(str(folder))
    )
    label = F.regexp_extract("path", r"class_(\d+)/", 1).cast("long")
    return df.select("path", "content", label.alias("label"))


def fingerprint_seconds(df) -> tuple[float, int] | None:
    """Seconds the library takes to fingerprint ``df``'s source (its dataset's cache key:
    the plan and each input file's size and modification time), which every fit's
    materialization step does before it looks for the dataset in the store, and the
    files counted; None where the library has no ``driver.cache_key.source_fingerprint``."""
    try:
        from spark_estimator.driver.cache_key import source_fingerprint
    except ImportError:
        return None
    start = time.perf_counter()
    files = len(source_fingerprint(df).get("files", []))
    return time.perf_counter() - start, files


def estimator(store, name: str, epochs: int, num_proc: int):
    from spark_estimator import TorchEstimator

    net = build(name)
    return TorchEstimator(
        model=net,
        optimizer=optimizer(net),
        loss=torch.nn.CrossEntropyLoss(),
        feature_cols=["content"],
        label_cols=["label"],
        decode_fn=decode,
        num_proc=num_proc,
        batch_size=GLOBAL_BATCH // num_proc,
        epochs=epochs,
        store=store,
        use_gpu=False,
        verbose=False,
    )


def timed_fit(est, df, store, images: int, epochs: int) -> dict:
    fit = bc.timed_fit(est, df, store)
    model = fit["model"]
    return {
        "total": fit["total"],
        "train_s": fit["train_s"],
        "rate": images * epochs / fit["train_s"] if fit["train_s"] else None,
        "whole_rate": images * epochs / fit["total"],
        "data_share": bc.time_share(model.getHistory()),
        "comm_share": bc.time_share(model.getHistory(), "communication"),
        "reused": fit["times"].get("reused"),
        "materialize_s": fit["times"].get("_materialize"),
        "loss": model.getHistory()[-1]["train"]["loss"] if model.getHistory() else None,
    }


def data_path_rate(store, num_proc: int) -> float | None:
    """Images/s of one rank's data path alone, on one core: rank 0's shard of the dataset
    the fit materialized in ``store``, read, shuffled, decoded by ``decode`` (its crop and
    flip) and collated as a training pass does, with no training. A fit's training on the
    same cores can be no faster than the data path and the model's step together."""
    import json

    import torch

    from spark_estimator.shared.serialization import pack_functions
    from spark_estimator.shared.spec import DatasetInfo, DecodeSpec
    from spark_estimator.worker.data.batch import Batch
    from spark_estimator.worker.data.loader import open_loader
    from spark_estimator.worker.data.shards import StepPlan
    from spark_estimator.worker.decode.decoder import Decoder

    metas = sorted(Path(store.datasets).glob("*/_meta.json"))
    if not metas:
        return None
    data = DatasetInfo.from_json(str(metas[0].parent), json.loads(metas[0].read_text()), True)
    decoding = DecodeSpec(functions=pack_functions(decode_fn=decode), pool="threads", workers=1)
    spec = bc.loader_only_spec(data, store, GLOBAL_BATCH // num_proc, decode=decoding)
    loader = open_loader(spec, "train", num_proc, 0, pin=False)
    decoder = Decoder(decoding, data.columns, {"label"}, 0, data.row_names)
    plan = StepPlan(data.rows("train"), num_proc, 0, spec.batch_size)
    rows, start = 0, time.perf_counter()
    with bc.torch_threads(1):
        for chunk in loader.batches(plan.batch_sizes, 1):
            rows += Batch(chunk, spec, torch.device("cpu"), None, decoder, 1).size
    decoder.close()
    return rows / (time.perf_counter() - start)


# -- the run --------------------------------------------------------------------------------------
def fmt(value, spec: str = ",.0f") -> str:
    return "n/a" if value is None else format(value, spec)


def ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, help=f"default {FULL_IMAGES:,} (--quick: 1,024)")
    parser.add_argument("--epochs", type=int, help=f"default {FULL_EPOCHS} (--quick: 1)")
    parser.add_argument("--repeats", type=int, help="timed runs of each side: 2 (--quick: 1)")
    parser.add_argument("--models", default=",".join(MODELS), help="small, large or both")
    bc.add_run_args(parser, "1,024 images, 1 epoch, 1 repeat")
    args = parser.parse_args()
    bc.fill_sizes(
        args, {"images": (FULL_IMAGES, 1024), "epochs": (FULL_EPOCHS, 1), "repeats": (2, 1)}
    )
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    hand_threads = bc.thread_counts(args.hand_threads)
    for name in models:
        build(name)  # refuses an unknown name before anything runs
    cores = os.cpu_count() or 1

    folder = image_folder(args.images, Path(args.data))
    files = image_files(folder)[: args.images]
    blobs = [Path(p).read_bytes() for p, _ in files]
    labels = [label for _, label in files]
    kib = sum(map(len, blobs)) / len(blobs) / 1024
    env = bc.machine(("PIL",))
    print(
        f"{len(files):,} JPEGs ({SIZE}x{SIZE}, mean {kib:.1f} KiB), {args.epochs} epoch(s); "
        f"{env['cpu']}, {cores} cores",
        flush=True,
    )

    contended = 0
    contended += not bc.wait_quiet(args.quiet_timeout)
    one_core = decode_limit(blobs[: min(len(blobs), 4096)], 1)
    contended += not bc.wait_quiet(args.quiet_timeout)
    limit = decode_limit(blobs, cores)
    print(
        f"decode limit: {limit:,.0f} images/s on {cores} processes ({one_core:,.0f} on one)",
        flush=True,
    )

    spark = bc.spark_session(args.master)
    df = frame(spark, folder)
    from spark_estimator import Store

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.store_dir) as tmp:
        warm = estimator(Store.create(tmp), models[0], 1, args.num_proc)
        warm.fit(df.limit(256))
    warmup_s = time.perf_counter() - start
    df.write.format("noop").mode("overwrite").save()
    print(f"warm-up fit (256 images, 1 epoch): {warmup_s:.1f} s", flush=True)
    fingerprint = fingerprint_seconds(df)
    if fingerprint:
        print(f"source fingerprint: {fingerprint[0]:.2f} s for {fingerprint[1]:,} files")

    steps = max(8, min(60, len(files) * args.epochs // GLOBAL_BATCH))
    results = {}
    for name in models:
        contended += not bc.wait_quiet(args.quiet_timeout)
        compute = 0.0
        for threads in hand_threads:
            with bc.torch_threads(threads):
                compute = max(compute, compute_limit(name, blobs, labels, steps))
        print(f"[{name}] compute limit: {compute:,.0f} images/s", flush=True)
        hands, fits, refits, data_path = [], [], [], None
        for r in range(args.repeats):
            for threads in hand_threads:
                contended += not bc.wait_quiet(args.quiet_timeout)
                with bc.torch_threads(threads):
                    hands.append(hand_loop(name, files, args.epochs, args.loader_workers))
                hands[-1]["threads"] = threads
                print(
                    f"[{name} {r + 1}] hand loop, {threads} torch thread(s): "
                    f"{hands[-1]['seconds']:.2f} s, {hands[-1]['rate']:,.0f} images/s, "
                    f"data share {hands[-1]['data_share']:.2f}",
                    flush=True,
                )
            store_folder = tempfile.mkdtemp(prefix="image-fit-store-", dir=args.store_dir)
            try:
                store = Store.create(store_folder)
                est = estimator(store, name, args.epochs, args.num_proc)
                for label, out in (("fit", fits), ("re-fit", refits)):
                    contended += not bc.wait_quiet(args.quiet_timeout)
                    out.append(timed_fit(est, df, store, len(files), args.epochs))
                    if label == "re-fit" and r == 0:
                        contended += not bc.wait_quiet(args.quiet_timeout)
                        data_path = data_path_rate(store, args.num_proc)
                        print(f"[{name}] data path alone: {fmt(data_path)} images/s a core")
                    f = out[-1]
                    print(
                        f"[{name} {r + 1}] {label}: {f['total']:.2f} s whole "
                        f"({f['whole_rate']:,.0f} images/s), training {fmt(f['train_s'], '.2f')}"
                        f" s ({fmt(f['rate'])} images/s), data share "
                        f"{fmt(f['data_share'], '.2f')}, comm share {fmt(f['comm_share'], '.2f')}, "
                        f"dataset reused {f['reused']}",
                        flush=True,
                    )
            finally:
                shutil.rmtree(store_folder, ignore_errors=True)
        results[name] = {
            "compute": compute,
            "hand": hands,
            "fit": fits,
            "refit": refits,
            "data_path": data_path,
        }
    spark.stop()

    full = (
        args.images >= FULL_IMAGES
        and args.epochs == FULL_EPOCHS
        and args.num_proc == 2
        and set(models) == set(MODELS)
    )
    lines = [
        f"## {env['date']}, stack `{env['venv']}`",
        "",
        *bc.machine_lines(env, ("PIL",)),
        f"- Job: {len(files):,} JPEGs {SIZE}x{SIZE} (mean {kib:.1f} KiB), {CLASSES} classes, "
        f"crop {CROP}, {args.epochs} epoch(s), "
        f"{'the full job' if full else 'SMALLER THAN THE FULL JOB'}; fit: num_proc "
        f"{args.num_proc} x batch {GLOBAL_BATCH // args.num_proc} on `{args.master}`; hand "
        f"loop: batch {GLOBAL_BATCH}, {args.loader_workers} DataLoader workers, "
        f"{' and '.join(map(str, hand_threads))} torch thread(s) (the fastest is the "
        f"baseline); {args.repeats} timed run(s) each, {contended} of them started while "
        "other processes kept the CPUs busy",
        f"- Decode limit (`decode_image`, {cores} processes): **{limit:,.0f} images/s** "
        f"({one_core:,.0f} images/s on one core)",
        f"- Untimed warm-up fit (256 images, 1 epoch, starts the Python workers): {warmup_s:.1f} s",
        "- The source's fingerprint (`driver.cache_key.source_fingerprint`, part of every fit's "
        "materialization, re-fits included): "
        + (
            f"{fingerprint[0]:.2f} s for {fingerprint[1]:,} files "
            f"({1000 * fingerprint[0] / max(1, fingerprint[1]):.2f} ms a file)"
            if fingerprint
            else "not measured (no such function)"
        ),
        "",
        "| model | run | images/s (training) | images/s (whole) | seconds (whole) "
        "| of which materialization | data share | comm share | last epoch's train loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts, summary = [], []
    for name, res in results.items():
        lines.append(f"| {name} | compute limit | {res['compute']:,.0f} | | | | | | |")
        for h in res["hand"]:
            lines.append(
                f"| {name} | hand loop, {h['threads']} thread(s) | {h['rate']:,.0f} | "
                f"{h['rate']:,.0f} | "
                f"{h['seconds']:.2f} | | {h['data_share']:.2f} | | {h['loss']:.4f} |"
            )
        for label, runs in (("first fit", res["fit"]), ("re-fit", res["refit"])):
            for f in runs:
                loss = fmt(f["loss"], ".4f")
                lines.append(
                    f"| {name} | {label} | {fmt(f['rate'])} | {f['whole_rate']:,.0f} | "
                    f"{f['total']:.2f} | {fmt(f['materialize_s'], '.2f')} | "
                    f"{fmt(f['data_share'], '.2f')} | {fmt(f['comm_share'], '.2f')} | {loss} |"
                )
        hand = max(h["rate"] for h in res["hand"])
        best = max(res["refit"], key=lambda f: f["rate"] or 0)
        first = max(res["fit"], key=lambda f: f["whole_rate"])
        decode_bound = limit < res["compute"]
        vs_hand = ratio(best["rate"], hand)
        share = best["data_share"]
        summary.append((name, decode_bound, share))
        regime = "decode-bound" if decode_bound else "compute-bound"
        verdicts.append(vs_hand is not None and vs_hand >= TARGET_HAND)
        text = (
            f"- `{name}` ({regime}: decode limit {limit:,.0f} {'<' if decode_bound else '>='} "
            f"compute limit {res['compute']:,.0f} images/s): re-fit training / hand loop "
            f"**{fmt(vs_hand, '.2f')}** (target >= {TARGET_HAND}: "
            f"{'met' if verdicts[-1] else 'MISSED'}); whole re-fit / hand loop "
            f"{fmt(ratio(best['whole_rate'], hand), '.2f')}, whole first fit / hand loop "
            f"{fmt(ratio(first['whole_rate'], hand), '.2f')}"
        )
        if decode_bound:
            vs_limit = ratio(best["rate"], limit)
            verdicts.append(vs_limit is not None and vs_limit >= TARGET_DECODE)
            text += (
                f"; re-fit training / decode limit **{fmt(vs_limit, '.2f')}** (target >= "
                f"{TARGET_DECODE}: {'met' if verdicts[-1] else 'MISSED'}); hand loop / "
                f"decode limit {hand / limit:.2f}"
            )
        if res["data_path"]:
            # the cores' time per image: one rank's data path and the model's step, each
            # run by all the cores
            ceiling = cores / (1 / res["data_path"] + 1 / res["compute"])
            text += (
                f". Data path alone: {res['data_path']:,.0f} images/s a core, "
                f"{cores * res['data_path'] / limit:.2f} of the decode limit; with the "
                f"model's step on the same cores at most {ceiling:,.0f} images/s "
                f"({ceiling / limit:.2f} of the decode limit), of which the re-fit trains "
                f"at {fmt(ratio(best['rate'], ceiling), '.2f')}"
            )
        lines.append(text)
    for name, decode_bound, share in summary:
        if share is None:
            reads = "not recorded"
        elif share >= DECODE_SHARE:
            reads = "decode-bound"
        elif share <= COMPUTE_SHARE:
            reads = "compute-bound"
        else:
            reads = "neither"
        right = reads == ("decode-bound" if decode_bound else "compute-bound")
        verdicts.append(right)
        lines.append(
            f"- `data=` share of `{name}`'s re-fit: {fmt(share, '.2f')}, reads {reads} "
            f"(>= {DECODE_SHARE}: decode-bound, <= {COMPUTE_SHARE}: compute-bound): "
            f"{'right' if right else 'WRONG'}"
        )
    section = "\n".join(lines) + "\n"
    print("\n" + section)
    bc.record(args, "image_fit", HEADER, section, env["venv"], full)
    print(f"targets met: {sum(verdicts)} of {len(verdicts)}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    sys.exit(main())
