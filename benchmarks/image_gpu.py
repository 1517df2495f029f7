"""Images/s of an image fit on one GPU against a hand ``DataLoader`` loop (issue 44).

A hand-run benchmark, not a test. The job is the one of issue 44's table, configured as GPU
clusters are: one ``local-cluster`` executor of all the machine's cores (16 on a lent
machine) and its GPU (``spark.executor.resource.gpu.amount 1``, found by
``conf/get_gpus_resources.sh``), ``spark.task.cpus 1`` and ``spark.task.resource.gpu.amount``
1/cores, as in ``conf/spark-defaults.gpu-fractional.conf``: the training job gets all the
cores and the whole GPU in one task through stage-level scheduling (docs/gpu.md); the
script checks in the training summary that it did (``task_resources``) and in
``ranks.json`` that the rank trained on ``cuda:0``.

The data: ``--images`` (16,384) 128x128 RGB JPEGs in 10 classes, made by
``image_fit.make_image`` (one folder per class, written once into ``--data``), read with
``spark.read.format("binaryFile")``, the label from the folder (``image_fit.frame``).
Training: a random 112x112 crop and a random horizontal flip of each image, batch 256,
float32 (torch's defaults on both sides), cross-entropy, SGD (lr 0.05, momentum 0.9), 2
epochs; two models (``--models``): ``small``, ``image_fit``'s small CNN (the crop subsampled
4x, two convolutions: decoding is the bottleneck), and ``resnet18``, torchvision's
(10 classes; ``x.float() / 255`` centred and scaled first, inside the model, as the small
CNN divides).

Side by side in one run, for each model (``--repeats`` times each, the best reported):

(a) the hand loop, what users run today: ``image_fit.ImageFiles`` (a ``Dataset`` reading
    each file and decoding it with Pillow, crop and flip by ``image_fit.decode``, seeded by
    (seed, epoch, image)), ``DataLoader(batch_size=256, num_workers=cores - 2 (14),
    pin_memory=True)`` shuffled each epoch (``image_fit.EpochShuffle``); the batch sent to
    the GPU (``non_blocking``), the same model, loss and optimizer. Its workers start at
    each epoch's ``iter(loader)``, as that loader's do. Images/s of the second epoch: the
    images / the seconds from ``iter(loader)`` to the last step done on the GPU
    (``torch.cuda.synchronize`` at both ends); its data share: the seconds spent in
    ``next()`` / those seconds;
(b) ``fit`` with ``decode_fn``: ``TorchEstimator(decode_fn=image_fit.decode, num_proc=1,
    batch_size=256, use_gpu=True)``, decoding in the library's default pool
    (``decode_pool="auto"``: worker processes where the task has more than 2 CPUs);
(c) ``fit`` with the default decoding, where ``spark_estimator.decoding`` has its batch
    forms (``decode_images``): no ``decode_fn``, a ``decode_batch_fn`` (``augment_batch``)
    that decodes the batch with ``decode_images`` (simplejpeg where it imports, else
    Pillow) and crops and flips it with the batch forms of ``random_crop`` and
    ``random_flip``, each row with its own generator; the CPU's decode pool as in (b);
(d) ``fit`` with ``decode_device="cuda"``: the batch's JPEGs decoded on the rank's GPU by
    torchvision, then ``augment_batch`` on that uint8 ``[B, 3, 128, 128]`` CUDA tensor
    (``decode_batch_fn``): the same crops and flips as (b) and (c), row for row (with the
    single-image helpers row by row where the batch forms have not landed).

For (b)-(d): images/s of the second epoch, the images / the rank's training seconds of
epoch 2 in the history (``seconds["train"]``: from the epoch's first batch drawn to the
device's last step done, the slowest rank's), and its data share, the progress bar's
``data=``: ``seconds["data"]`` (the step waiting for its batch) / ``seconds["train"]``.
Also shown: epoch 1's seconds, the fit's wall time, the pool and workers that decoded (the
training summary's ``decoding``, and its note where worker processes were asked for and
shared memory was too small for them). The JPEG bytes are materialized once before the
timed fits (``materialize``, untimed); every fit reuses them. Before each timed side the
script waits (up to ``--quiet-timeout``) for other processes to leave the CPUs idle.

Targets (issue 44): (b) and (c), CPU decoding, >= 1.0x (a) with both models; (d) >= 1.0x
(a). The bold ratios are these.

``--cpu-small`` checks the script on a machine without a GPU (torchvision does not load
with the CPU torch of ``.venv``): the small CNN only, 768 images, batch 64 (a dozen steps
an epoch), ``local[2]`` with ``spark.task.cpus 2`` (the one training task gets both
cores), CPU; (b) and (c) each with ``decode_pool="processes"`` and ``"threads"``
(``--pools``), against ``DataLoader(num_workers=2)`` with one torch thread in the training
process (on 2 busy cores the faster: results/image_fit.md); 2 runs of each side, the best
reported (an epoch takes a fraction of a second there). About a minute on 2 quiet cores.

Results are printed and written to ``benchmarks/results/image_gpu.md``, one section for
the GPU job and one for ``--cpu-small`` (each run at its mode's default sizes replaces its
section; other sizes write to a temporary folder; ``--no-record`` writes nothing), with
the machine, the GPU, the code's commit.

On a lent GPU machine (no Java, no pyspark, no registry: ``../shared/gpu/README.md``),
first here, from the repository root, with the benchmark committed (the runtime packs the
committed HEAD): the runtime as that README's step 1 says, and the wheel of simplejpeg,
(c)'s JPEG decoder, which that machine does not list (0.4 MB):

    .venv/bin/pip download simplejpeg --python-version 3.12 --only-binary=:all: \\
        --no-deps -d .gpu/wheels

then the runtime's two pieces in two calls (``cp .gpu/c0 /tmp/chunks/``, carrying
``.gpu/c0``; the same for ``.gpu/c1``), and in a third call carrying ``.gpu/c2``,
``.gpu/proj.tgz``, ``.gpu/env.sh`` and ``.gpu/wheels``, with ``timeout_s`` near 420:

    source .gpu/env.sh .gpu && \\
    python3 -m pip install -q --no-index --no-deps --target /tmp/rt/site .gpu/wheels/*.whl && \\
    export SPARK_ESTIMATOR_BENCH_COMMIT=$(python3 -c "import tarfile; \\
        print(tarfile.open('.gpu/proj.tgz').pax_headers['comment'])") && \\
    cd /tmp/proj && timeout 400 python3 benchmarks/gpu_check.py image-gpu 2>&1 | tee $OUT/log; \\
    cp benchmarks/results/image_gpu.md $OUT/

(``/tmp/rt/site`` is on the ``PYTHONPATH`` that env.sh sets, so the driver, the executor
and the decode workers import simplejpeg from there; the project there is the committed
HEAD without git, so the results name its commit from ``SPARK_ESTIMATOR_BENCH_COMMIT``,
which ``git archive`` wrote into proj.tgz), and copy ``image_gpu.md`` back into
``benchmarks/results/``. Sized for under 4 minutes on a 16-core H200, an estimate: not yet
run there (the log prints each step's wall time); ``--images``, ``--models`` and
``--repeats`` make it smaller or larger.

    python benchmarks/image_gpu.py                       # the GPU job
    .venv/bin/python benchmarks/image_gpu.py --cpu-small  # here, ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402
import image_fit  # noqa: E402
import torch  # noqa: E402

from spark_estimator import decoding  # noqa: E402

bc.by_value(image_fit)

FULL_IMAGES, SMALL_IMAGES = 16_384, 768
FULL_BATCH, SMALL_BATCH = 256, 64
EPOCHS = 2
CROP, CLASSES = image_fit.CROP, image_fit.CLASSES
MODELS = ("small", "resnet18")
TARGET = 1.0
DISCOVERY = bc.ROOT / "conf" / "get_gpus_resources.sh"
GPU_SECTION, CPU_SECTION = "GPU", "CPU (--cpu-small)"
COMMIT_ENV = "SPARK_ESTIMATOR_BENCH_COMMIT"  # the code's commit where there is no git
HEADER = """\
# Image fit on a GPU (benchmarks/image_gpu.py)

Images/s of the second epoch of `TorchEstimator.fit` on one GPU (`num_proc=1`, batch 256,
a `local-cluster` executor of all the cores and the GPU, tasks of 1/cores of a GPU, so the
training task gets every core through stage-level scheduling) on 16,384 generated 128x128
JPEGs read with `spark.read.format("binaryFile")`, random 112x112 crop and flip, float32;
against the hand loop users run today: a `Dataset` over the same files with Pillow,
`DataLoader(num_workers=cores - 2, pin_memory=True)`, the same model and loop. Columns:
`decode_fn` (Pillow, crop and flip per row), the default decoding (`decode_images` with
`decode_batch_fn` doing the batch crop and flip on the CPU), `decode_device="cuda"`
(torchvision on the GPU, the same `decode_batch_fn` on the GPU's batch). Models: a small
CNN (decode-bound) and torchvision's resnet18. Targets (issue 44): every fit >= 1.0x the
hand loop, with both models. `--cpu-small` runs the script on 2 CPU cores (the small CNN,
768 images, batch 64, `local[2]`, both decode pools). See the script's docstring for how
each number is obtained.

    python benchmarks/image_gpu.py                       # on a machine with a CUDA GPU
    .venv/bin/python benchmarks/image_gpu.py --cpu-small  # without one
"""


# -- the models ---------------------------------------------------------------------------------
class ResNet18(torch.nn.Module):
    """torchvision's resnet18 (``CLASSES`` logits) on uint8 images: ``x.float() / 255``
    less 0.45, over 0.225 (about ImageNet's mean and standard deviation)."""

    def __init__(self):
        super().__init__()
        from torchvision.models import resnet18

        self.net = resnet18(num_classes=CLASSES)

    def forward(self, x):
        return self.net(x.float().div_(255).sub_(0.45).div_(0.225))


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "resnet18":
        return ResNet18()
    return image_fit.build(name)


# -- the batch decoding of columns (c) and (d) -----------------------------------------------------
def augment_batch(rows: dict, augments) -> dict:
    """``decode_batch_fn`` of (c) and (d): the batch's images as uint8 ``[B, 3, 128, 128]``
    (decoded on the GPU already with ``decode_device="cuda"``, else by ``decode_images``),
    each row cropped to 112x112 and flipped as its own generator draws (the centre crop
    without ``augments``)."""
    images = rows["content"]
    if not isinstance(images, torch.Tensor):
        images = decoding.decode_images(images)
    if augments is None:
        return {"content": decoding.center_crop(images, CROP)}
    if hasattr(decoding, "decode_images"):  # the batch forms of random_crop and random_flip
        crops = decoding.random_crop(images, CROP, augments)
        return {"content": decoding.random_flip(crops, augments)}
    crops = [
        decoding.random_flip(decoding.random_crop(image, CROP, g), g)
        for image, g in zip(images, augments)
    ]
    return {"content": torch.stack(crops)}


# -- (a) the hand loop --------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hand_loop(name: str, files, batch: int, workers: int, device: torch.device) -> dict:
    """The hand loop (a), ``EPOCHS`` epochs: each epoch's seconds and data share, the
    second epoch's images/s, the mean loss of its last epoch."""
    net = build(name).to(device).train()
    opt = image_fit.optimizer(net)
    loss_fn = torch.nn.CrossEntropyLoss()
    loader = torch.utils.data.DataLoader(
        image_fit.ImageFiles(files),
        batch_size=batch,
        sampler=image_fit.EpochShuffle(len(files)),
        num_workers=workers,
        pin_memory=device.type == "cuda",
    )
    seconds, shares, losses = [], [], []
    for _ in range(EPOCHS):
        synchronize(device)
        start = time.perf_counter()
        waited, losses = image_fit.train_pass(loader, net, opt, loss_fn, device)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        shares.append(waited / seconds[-1])
    return {
        "epoch_s": seconds,
        "rate": len(files) / seconds[-1],
        "data_share": shares[-1],
        "loss": float(torch.stack(losses).mean()),
    }


# -- (b)-(d) the fits ---------------------------------------------------------------------------
def estimator(store, name: str, column: str, pool: str, batch: int, gpu: bool):
    """The fit of ``column`` ("decode_fn", "default" or "cuda") for model ``name``."""
    from spark_estimator import TorchEstimator

    net = build(name)
    decoding_params = {
        "decode_fn": {"decode_fn": image_fit.decode, "decode_pool": pool},
        "default": {"decode_batch_fn": augment_batch, "decode_pool": pool},
        "cuda": {"decode_batch_fn": augment_batch, "decode_device": "cuda"},
    }[column]
    return TorchEstimator(
        model=net,
        optimizer=image_fit.optimizer(net),
        loss=torch.nn.CrossEntropyLoss(),
        feature_cols=["content"],
        label_cols=["label"],
        num_proc=1,
        batch_size=batch,
        epochs=EPOCHS,
        store=store,
        use_gpu=gpu,
        verbose=False,
        **decoding_params,
    )


def timed_fit(est, df, store, images: int) -> dict:
    """One fit: the second epoch's images/s and data share from the history, epoch 1's
    seconds, the wall time, how it decoded, on which device and with how many CPUs."""
    fit = bc.timed_fit(est, df, store)
    model = fit["model"]
    history = model.getHistory()
    summary = model.getTrainingSummary()
    epochs = [max(r["seconds"]["train"]) for r in history]
    last = history[-1]["seconds"]
    decoders = summary.get("decoding") or [{}]
    return {
        "epoch_s": epochs,
        "rate": images / epochs[-1],
        "data_share": sum(last["data"]) / sum(last["train"]),
        "total": fit["total"],
        "pool": decoders[0].get("pool"),
        "workers": decoders[0].get("workers"),
        "note": decoders[0].get("note"),
        "devices": sorted({r.get("device") for r in fit["ranks"]}),
        "task_cpus": (summary.get("task_resources") or {}).get("task_cpus"),
        "loss": history[-1]["train"]["loss"],
    }


def spark_cluster(cores: int, memory_mb: int, gpu: bool, master: str | None):
    """GPU: one local-cluster executor of ``cores`` cores and the GPU, tasks of 1/cores of
    it (the training job takes all in one task, by stage-level scheduling). CPU:
    ``master`` with tasks of every core."""
    if not gpu:
        return bc.spark_session(master, {"spark.task.cpus": cores}), master
    conf = {
        "spark.executor.cores": cores,
        "spark.task.cpus": 1,
        "spark.worker.resource.gpu.amount": 1,
        "spark.worker.resource.gpu.discoveryScript": DISCOVERY,
        "spark.executor.resource.gpu.amount": 1,
        "spark.executor.memory": f"{memory_mb // 2}m",
        "spark.task.resource.gpu.amount": 1 / cores,
        "spark.dynamicAllocation.enabled": "false",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
    }
    master = f"local-cluster[1,{cores},{memory_mb}]"
    return bc.spark_session(master, conf), master


# -- the run --------------------------------------------------------------------------------------
def fmt(value, spec: str = ",.0f") -> str:
    return "n/a" if value is None else format(value, spec)


LABELS = {
    "decode_fn": "fit, `decode_fn` (Pillow, per row)",
    "default": "fit, default decoding (`decode_images` + batch crop/flip)",
    "cuda": 'fit, `decode_device="cuda"` + `decode_batch_fn`',
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-small", action="store_true", help="the small check on CPU")
    parser.add_argument("--images", type=int, help=f"{FULL_IMAGES:,} (--cpu-small: 768)")
    parser.add_argument("--batch-size", type=int, help="256 (--cpu-small: 64)")
    parser.add_argument("--models", help="small, resnet18 or both (--cpu-small: small)")
    parser.add_argument("--pools", help="decode_pool of (b), (c): auto (--cpu-small: both)")
    parser.add_argument("--repeats", type=int, help="timed runs of each side: 1 (--cpu-small: 2)")
    parser.add_argument("--loader-workers", type=int, help="the hand loop's: cores - 2")
    parser.add_argument(
        "--executor-memory-mb", type=int, default=16384, help="the worker's; the executor half"
    )
    parser.add_argument("--master", default="local[2]", help="--cpu-small's master")
    parser.add_argument("--data", default=str(bc.DATA), help="folder of the generated JPEGs")
    parser.add_argument("--store-dir", default=tempfile.gettempdir(), help="where stores go")
    parser.add_argument("--quiet-timeout", type=float, help="60 s (GPU: 5 s)")
    bc.add_record_args(parser)
    args = parser.parse_args()
    small, gpu = args.cpu_small, not args.cpu_small
    # the training task's CPUs: the machine's on the GPU cluster, the master's threads on CPU
    local = re.fullmatch(r"local\[(\d+)\]", args.master)
    cores = int(local[1]) if small and local else os.cpu_count() or 1
    if gpu and not torch.cuda.is_available():
        print(
            f"image_gpu.py: no CUDA GPU here (torch {torch.__version__}: "
            "torch.cuda.is_available() is False); --cpu-small checks the script on CPU.",
            file=sys.stderr,
        )
        return 2
    images = args.images or (SMALL_IMAGES if small else FULL_IMAGES)
    repeats = args.repeats or (2 if small else 1)
    batch = args.batch_size or (SMALL_BATCH if small else FULL_BATCH)
    models = [
        m.strip() for m in (args.models or ("small" if small else ",".join(MODELS))).split(",")
    ]
    pools = [
        p.strip() for p in (args.pools or ("processes,threads" if small else "auto")).split(",")
    ]
    workers = args.loader_workers or max(1, cores - 2 if gpu else cores)
    quiet = args.quiet_timeout if args.quiet_timeout is not None else (5.0 if gpu else 60.0)
    for name in models:
        if name not in MODELS:
            parser.error(f"--models: {name!r} is not one of {MODELS}")
    if small and "resnet18" in models:
        parser.error(
            "--cpu-small: the small CNN only (torchvision does not load with .venv's torch)"
        )
    batch_helpers = hasattr(decoding, "decode_images")
    columns = ["decode_fn"] + (["default"] if batch_helpers else []) + (["cuda"] if gpu else [])
    device = torch.device("cuda" if gpu else "cpu")
    began = time.perf_counter()

    def clock(what: str) -> None:
        print(f"[{time.perf_counter() - began:6.1f} s] {what}", flush=True)

    folder = image_fit.image_folder(images, Path(args.data))
    files = image_fit.image_files(folder)[:images]
    if len(files) < images:
        parser.error(f"--data: {folder} holds {len(files)} images, not {images}")
    kib = sum(os.path.getsize(p) for p, _ in files) / len(files) / 1024
    env = bc.machine(("PIL", "simplejpeg", "torchvision"))
    if env["commit"] in ("?", "unknown") and os.environ.get(COMMIT_ENV):
        env["commit"] = f"{os.environ[COMMIT_ENV][:7]} ({COMMIT_ENV}: the checkout has no git)"
    shm = shutil.disk_usage("/dev/shm").free / 2**30 if os.path.isdir("/dev/shm") else None
    clock(
        f"{len(files):,} JPEGs ({kib:.1f} KiB each); {env['cpu']}, {cores} cores; GPU {env['gpu']}"
    )

    spark, master = spark_cluster(cores, args.executor_memory_mb, gpu, args.master)
    df = image_fit.frame(spark, folder)
    from spark_estimator import Store

    store_folder = tempfile.mkdtemp(prefix="image-gpu-store-", dir=args.store_dir)
    results: dict[str, dict] = {}
    contended = 0
    try:
        store = Store.create(store_folder)
        estimator(store, models[0], "decode_fn", pools[0], batch, gpu).materialize(df)
        clock("the JPEGs materialized in the store")
        for name in models:
            hands, fits = [], {}
            for r in range(repeats):
                contended += not bc.wait_quiet(quiet)
                threads = torch.get_num_threads() if gpu else 1
                with bc.torch_threads(threads):
                    hands.append(hand_loop(name, files, batch, workers, device))
                if gpu:
                    torch.cuda.empty_cache()
                h = hands[-1]
                clock(
                    f"[{name} {r + 1}] hand loop: epoch 2 {h['epoch_s'][-1]:.2f} s, "
                    f"{h['rate']:,.0f} images/s, data share {h['data_share']:.2f}"
                )
                for column in columns:
                    for pool in pools if column != "cuda" else ["-"]:
                        contended += not bc.wait_quiet(quiet)
                        est = estimator(store, name, column, pool, batch, gpu)
                        f = timed_fit(est, df, store, len(files))
                        f["asked"] = pool
                        fits.setdefault((column, pool), []).append(f)
                        clock(
                            f"[{name} {r + 1}] {column} ({f['pool']} x {f['workers']}): "
                            f"epoch 2 {f['epoch_s'][-1]:.2f} s, {f['rate']:,.0f} images/s, "
                            f"data share {f['data_share']:.2f}; fit {f['total']:.1f} s on "
                            f"{f['devices']}, {f['task_cpus']} CPUs"
                        )
            results[name] = {"hand": hands, "fits": fits}
    finally:
        spark.stop()
        shutil.rmtree(store_folder, ignore_errors=True)
    clock("done")

    full = images == (SMALL_IMAGES if small else FULL_IMAGES) and batch == (
        SMALL_BATCH if small else FULL_BATCH
    )
    if gpu:
        full = full and set(models) == set(MODELS)
    size = "the mode's default size" if full else "NOT THE MODE'S DEFAULT SIZE"
    lines = [
        f"## {env['date']}, {'`--cpu-small`' if small else 'GPU'}, stack `{env['venv']}`",
        "",
        *bc.machine_lines(env, ("PIL", "simplejpeg", "torchvision")),
        f"- Job: {len(files):,} JPEGs 128x128 (mean {kib:.1f} KiB), crop {CROP} + flip, "
        f"batch {batch}, {EPOCHS} epochs, float32, images/s of epoch 2; "
        f"{size}; fit: num_proc 1 on `{master}`"
        + (
            f" (spark.executor.cores {cores}, spark.task.cpus 1, "
            f"spark.task.resource.gpu.amount 1/{cores})"
            if gpu
            else f" (spark.task.cpus {cores})"
        )
        + f"; hand loop: `DataLoader(num_workers={workers}"
        + (", pin_memory=True)`" if gpu else ")`, 1 torch thread")
        + f"; {repeats} run(s) each, {contended} started while other processes kept "
        "the CPUs busy",
        f"- Shared memory (/dev/shm) free: {fmt(shm, '.1f')} GiB; batch forms of "
        f"`decoding` (`decode_images`, column (c)): {'yes' if batch_helpers else 'NOT YET'}; "
        f"whole run {time.perf_counter() - began:.0f} s",
        "",
        "| model | run | decoded by | images/s (epoch 2) | x hand loop | data share (epoch 2) "
        "| epoch 1 s | epoch 2 s | fit wall s | loss (epoch 2) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts, notes = [], set()
    for name, res in results.items():
        hand = max(h["rate"] for h in res["hand"])
        for h in res["hand"]:
            lines.append(
                f"| {name} | hand `DataLoader` | {workers} worker processes | {h['rate']:,.0f} "
                f"| {h['rate'] / hand:.2f} | {h['data_share']:.2f} | {h['epoch_s'][0]:.2f} | "
                f"{h['epoch_s'][1]:.2f} | | {h['loss']:.4f} |"
            )
        for (column, pool), runs in res["fits"].items():
            for f in runs:
                where = f"{f['pool']} x {f['workers']}" + (
                    f" (asked {pool})" if pool not in ("-", f["pool"]) else ""
                )
                if column == "cuda":
                    where = f"the GPU, then {where}"
                lines.append(
                    f"| {name} | {LABELS[column]} | {where} | {f['rate']:,.0f} | "
                    f"{f['rate'] / hand:.2f} | {f['data_share']:.2f} | {f['epoch_s'][0]:.2f} | "
                    f"{f['epoch_s'][1]:.2f} | {f['total']:.1f} | {f['loss']:.4f} |"
                )
                if f["note"]:
                    notes.add(f["note"])
    lines.append("")
    for name, res in results.items():
        hand = max(h["rate"] for h in res["hand"])
        for (column, pool), runs in res["fits"].items():
            best = max(runs, key=lambda f: f["rate"])
            ratio = best["rate"] / hand
            right_place = not gpu or (best["devices"] == ["cuda:0"] and best["task_cpus"] == cores)
            met = ratio >= TARGET and right_place
            verdicts.append(met)
            asked = "" if pool == "-" else f", decode_pool={pool!r}"
            lines.append(
                f"- `{name}`, {LABELS[column]}{asked}: / hand loop **{ratio:.3f}** (target >= "
                f"{TARGET}: {'met' if met else 'MISSED'})"
                + (
                    ""
                    if right_place
                    else f" (trained on {best['devices']} with {best['task_cpus']} CPUs, not "
                    f"cuda:0 with {cores}: void)"
                )
            )
    lines += [f"- Note from the fit: {note}" for note in sorted(notes)]
    section = "\n".join(lines) + "\n"
    print("\n" + section)
    bc.record(args, "image_gpu", HEADER, section, CPU_SECTION if small else GPU_SECTION, full)
    print(f"targets met: {sum(verdicts)} of {len(verdicts)}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    sys.exit(main())
