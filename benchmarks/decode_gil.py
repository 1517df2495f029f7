"""Wall and GIL-held microseconds per image of the default image decoding and a Pillow
``decode_fn``, on 128x128 JPEGs.

A hand-run benchmark, not a test. The images: ``--images`` (2,048) JPEGs made by
``image_fit.make_image`` (128x128 RGB, quality 90, 4:2:0, about 7 KB: a gradient, shapes and
noise), held in memory as bytes. Each way of decoding them, timed in this process with one
torch thread (``torch.set_num_threads(1)``, so that no torch thread takes the second core):

- ``decode_image``: ``decoding.decode_image`` (Pillow) on each image, one at a time;
- ``decode_fn``: what a typical Pillow ``decode_fn`` does for each row, its generator
  ``np.random.default_rng([seed, epoch, row])`` (as the fit seeds a row's), ``decode_image``,
  ``random_crop`` to 112 and ``random_flip``; then ``torch.stack`` of each batch of 256, as
  the loader collates them;
- ``decode_images``: ``decoding.decode_images`` on batches of 256 (simplejpeg where it
  imports: the script says which decoder ran);
- ``decode_images + crop/flip``: the same, then the 256 rows' generators (as above) and the
  batch forms of ``random_crop`` (112) and ``random_flip``;
- ``decode_images, Pillow``: ``decode_images`` with simplejpeg hidden (every image through
  ``decode_image`` into its slot): the batch path's own cost without simplejpeg.

(a) Wall microseconds per image: one thread, nothing else of this process running; the
    images decoded ``--repeats`` times, the best pass (and the median) over the number of
    images.

(b) GIL-held microseconds per image, measured as another thread's lost time: a second
    thread runs a pure-Python loop that counts (``while not stop: n += 1``), which runs
    whenever it holds the GIL, while this thread decodes ``--gil-images`` (512) images.
    Linux's scheduler statistics of the counting thread (``/proc/self/task/<tid>/
    schedstat``: its seconds on a CPU, and its seconds runnable but waiting for one) split
    its time T into running, waiting for a CPU (other processes on its core: the
    machine's noise, left out), and the rest, when it was blocked: waiting for the GIL.
    The blocked time over the images is the figure; the median of ``--repeats``
    measurements, each started once the CPUs are idle (``bench_common.wait_quiet``). On
    two cores the decoder and the counter each have one, so the counter is blocked while
    the decoder holds the GIL, and while the GIL is handed over: a decoder that releases
    the GIL for long enough to wake the counter (a decode, not a header's microsecond)
    has to wait for it back, and each hand-over costs the counter a thread's wake-up or
    two. ``sleep(0)`` (one release and re-take of the GIL, nothing done) measures a
    hand-over: its row is per release. The hand-over is part of what a GIL-releasing call
    costs the process's other threads, so it stays in the figures. The decoder waits for
    its GIL back at most ``sys.setswitchinterval`` (set to ``--switch-interval``, 50 us);
    ``--check-interval`` measures the GIL figures again at a second interval (500 us):
    a hand-over costs more there (the ``sleep(0)`` row; slower wake-ups after longer idle
    waits, it seems), so the figures of decoders with many hand-overs grow with it, and
    the figure of one that hands over little does not. This thread's own time
    waiting for a CPU is given per image too (a preempted decoder holding the GIL blocks
    the counter): a large one marks a disturbed measurement.

Results are printed and written to ``benchmarks/results/decode_gil.md`` (a run smaller than
the full one to a temporary folder; ``--no-record`` writes nothing). Run on a quiet machine::

    .venv/bin/python benchmarks/decode_gil.py                      # ~2 min on 2 cores
    .venv/bin/python benchmarks/decode_gil.py --quick --no-record  # ~20 s
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from image_fit import CROP, make_image  # noqa: E402

from spark_estimator.decoding import batch as batch_images  # noqa: E402
from spark_estimator.decoding import (  # noqa: E402
    decode_image,
    decode_images,
    random_crop,
    random_flip,
)

FULL_IMAGES, FULL_GIL_IMAGES, FULL_REPEATS = 2048, 512, 5
BATCH, EPOCH = 256, 0
HEADER = """\
# Decoding and the GIL (benchmarks/decode_gil.py)

Wall and GIL-held microseconds per image, 128x128 JPEGs (`image_fit.make_image`, about 7 KB),
in one thread: `decode_image` (Pillow) per image; a typical Pillow `decode_fn` (the row's
generator, `decode_image`, `random_crop` 112, `random_flip`, the batch stacked);
`decode_images` on batches of 256 (simplejpeg), alone and with the batch crop and flip;
`decode_images` with simplejpeg hidden (Pillow into the slots). GIL-held: the time a
pure-Python counting thread on the other core is blocked (the scheduler's statistics: not
running, not waiting for a CPU) per image while the decoding runs, hand-overs of the GIL
included (the `sleep(0)` row: one release and re-take, nothing done, per release). See the
script's docstring for how each number is obtained.

    .venv/bin/python benchmarks/decode_gil.py [--images N] [--repeats R]
"""


# -- the ways of decoding ----------------------------------------------------------------------
def per_image(data: list[bytes]) -> None:
    for image in data:
        decode_image(image)


def decode_fn(row: int, image: bytes) -> torch.Tensor:
    augment = np.random.default_rng([bc.SEED, EPOCH, row])
    return random_flip(random_crop(decode_image(image), CROP, augment), augment)


def per_row_fn(data: list[bytes]) -> None:
    for start in range(0, len(data), BATCH):
        rows = range(start, min(start + BATCH, len(data)))
        torch.stack([decode_fn(row, data[row]) for row in rows])


def batches(data: list[bytes]) -> None:
    for start in range(0, len(data), BATCH):
        decode_images(data[start : start + BATCH])


def batches_augmented(data: list[bytes]) -> None:
    for start in range(0, len(data), BATCH):
        batch = decode_images(data[start : start + BATCH])
        rows = range(start, start + len(batch))
        augments = [np.random.default_rng([bc.SEED, EPOCH, row]) for row in rows]
        random_flip(random_crop(batch, CROP, augments), augments)


def batches_pillow(data: list[bytes]) -> None:
    hidden = batch_images._simplejpeg
    batch_images._simplejpeg = lambda: None  # as without simplejpeg installed
    try:
        batches(data)
    finally:
        batch_images._simplejpeg = hidden


def releases(count: int) -> Callable[[list[bytes]], None]:
    """``count`` releases and re-takes of the GIL with nothing done (``time.sleep(0)``)."""

    def release(data: list[bytes]) -> None:
        for _ in range(count):
            time.sleep(0)

    return release


# -- the measurements --------------------------------------------------------------------------
def wall_us(fn, data: list[bytes], repeats: int) -> tuple[float, float]:
    """Best and median microseconds per image of ``fn(data)`` over ``repeats`` passes."""
    fn(data[:BATCH])  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(data)
        seconds.append(time.perf_counter() - start)
    return min(seconds) * 1e6 / len(data), statistics.median(seconds) * 1e6 / len(data)


def _schedstat() -> tuple[float, float]:
    """This thread's seconds on a CPU and seconds runnable but waiting for one (Linux's
    ``/proc/self/task/<tid>/schedstat``)."""
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
        ran, waited, _ = f.read().split()
    return int(ran) / 1e9, int(waited) / 1e9


def _count(state: dict) -> None:
    stop, n = state["stop"], 0
    ran, waited = _schedstat()
    start = time.perf_counter()
    while not stop:
        n += 1
    elapsed = time.perf_counter() - start
    ran_end, waited_end = _schedstat()
    state["blocked"] = elapsed - (ran_end - ran) - (waited_end - waited)


def blocked_seconds(work: Callable[[], None]) -> tuple[float, float]:
    """The seconds the counting thread was blocked while this thread ran ``work`` (neither
    running nor waiting for a CPU: waiting for the GIL), and this thread's seconds waiting
    for a CPU meanwhile (other processes' doing, the measurement's noise)."""
    state: dict = {"stop": []}
    thread = threading.Thread(target=_count, args=(state,))
    thread.start()
    time.sleep(0.02)  # the counter is counting
    waited = _schedstat()[1]
    work()
    waited = _schedstat()[1] - waited
    state["stop"].append(True)
    thread.join()
    return state["blocked"], waited


def gil_us(fn, data: list[bytes], units: int) -> tuple[float, float]:
    """Microseconds per unit (image, or release) the counting thread was blocked while
    ``fn(data)`` ran, and this thread's microseconds per unit waiting for a CPU."""
    blocked, waited = blocked_seconds(lambda: fn(data))
    return blocked * 1e6 / units, waited * 1e6 / units


def measure(
    ways: dict, data: list[bytes] | None, gil_data: list[bytes], args, interval: float
) -> tuple[dict, int]:
    """Each way's GIL figure (median over the repeats, its range, and this thread's median
    wait for a CPU) at switch ``interval``, and its wall time unless ``data`` is None."""
    sys.setswitchinterval(interval)
    rows, contended = {}, 0
    for name, fn in ways.items():
        units = len(gil_data) if name != "sleep(0)" else args.releases
        runs = []
        for _ in range(args.repeats):
            contended += not bc.wait_quiet(args.quiet_timeout)
            runs.append(gil_us(fn, gil_data, units))
        held = sorted(gil for gil, _ in runs)
        row = rows[name] = {
            "gil": statistics.median(held),
            "gil_range": (held[0], held[-1]),
            "cpu_wait": statistics.median(waited for _, waited in runs),
        }
        if data is not None and name != "sleep(0)":
            contended += not bc.wait_quiet(args.quiet_timeout)
            row["wall"] = wall_us(fn, data, args.repeats)
        wall = row.get("wall")
        print(
            f"  {name:28s} "
            + (f"wall {wall[0]:7.1f} us (median {wall[1]:7.1f}), " if wall else " " * 32)
            + f"GIL {row['gil']:6.1f} us (range {held[0]:.1f}-{held[-1]:.1f}; "
            f"waited for a CPU {row['cpu_wait']:.1f})",
            flush=True,
        )
    return rows, contended


def table(rows: dict, check: dict | None, check_interval: float) -> list[str]:
    columns = [
        "",
        "wall us/image: best (median)",
        "GIL-held us/image: median (range)",
        "waited for a CPU, us/image",
    ]
    if check is not None:
        columns.append(f"GIL-held at a {check_interval * 1e6:.0f} us switch interval")
    lines = ["| " + " | ".join(columns) + " |", "|---|" + "---:|" * (len(columns) - 1)]
    for name, row in rows.items():
        wall = f"{row['wall'][0]:.1f} ({row['wall'][1]:.1f})" if "wall" in row else "-"
        low, high = row["gil_range"]
        unit = " per release" if name == "sleep(0)" else ""
        cells = [name, wall, f"**{row['gil']:.1f}**{unit} ({low:.1f}-{high:.1f})"]
        cells.append(f"{row['cpu_wait']:.1f}")
        if check is not None:
            cells.append(f"{check[name]['gil']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, help=f"default {FULL_IMAGES:,} (--quick: 512)")
    parser.add_argument(
        "--gil-images", type=int, help=f"images per GIL measurement: {FULL_GIL_IMAGES}"
    )
    parser.add_argument("--repeats", type=int, help=f"default {FULL_REPEATS} (--quick: 3)")
    parser.add_argument("--releases", type=int, default=2000, help="sleep(0) calls measured")
    parser.add_argument("--switch-interval", type=float, default=50e-6, help="seconds")
    parser.add_argument(
        "--check-interval",
        type=float,
        default=500e-6,
        help="a second switch interval the GIL figures are measured at (0: none)",
    )
    parser.add_argument("--quiet-timeout", type=float, default=60.0)
    parser.add_argument("--quick", action="store_true", help="512 images, 3 repeats")
    bc.add_record_args(parser)
    args = parser.parse_args()
    bc.fill_sizes(
        args,
        {
            "images": (FULL_IMAGES, 512),
            "gil_images": (FULL_GIL_IMAGES, 256),
            "repeats": (FULL_REPEATS, 3),
        },
    )
    torch.set_num_threads(1)
    simplejpeg = batch_images._simplejpeg()
    env = bc.machine(("PIL", "simplejpeg") if simplejpeg else ("PIL",))
    data = [make_image(i) for i in range(args.images)]
    gil_data = data[: args.gil_images]
    size_kib = sum(map(len, data)) / len(data) / 1024
    jpeg = f"simplejpeg {simplejpeg.__version__}" if simplejpeg else "Pillow (no simplejpeg)"
    print(
        f"{args.images:,} JPEGs 128x128 ({size_kib:.1f} KiB each); decode_images' JPEGs: "
        f"{jpeg}; {env['cpu']}, {env['cores']} cores, load {env['load']:.2f}",
        flush=True,
    )
    ways = {
        "sleep(0)": releases(args.releases),
        "decode_image (Pillow)": per_image,
        "Pillow decode_fn": per_row_fn,
        "decode_images": batches,
        "decode_images + crop/flip": batches_augmented,
        "decode_images, Pillow": batches_pillow,
    }
    print(f"switch interval {args.switch_interval * 1e6:.0f} us:", flush=True)
    rows, contended = measure(ways, data, gil_data, args, args.switch_interval)
    check = None
    if args.check_interval:
        print(f"switch interval {args.check_interval * 1e6:.0f} us (GIL only):", flush=True)
        check, more = measure(ways, None, gil_data, args, args.check_interval)
        contended += more
    sys.setswitchinterval(0.005)

    section = [
        f"## {env['date']}, stack `{env['venv']}`",
        "",
        *bc.machine_lines(env, ("PIL", "simplejpeg") if simplejpeg else ("PIL",)),
        f"- Images: {args.images:,} JPEGs 128x128 (mean {size_kib:.1f} KiB), "
        f"{args.gil_images:,} per GIL measurement, {args.repeats} repeat(s); "
        f"decode_images' JPEGs by {jpeg}; one torch thread; switch interval "
        f"{args.switch_interval * 1e6:.0f} us; {contended} measurement(s) started while "
        "other processes kept the CPUs busy",
        "",
        *table(rows, check, args.check_interval),
        "",
    ]
    text = "\n".join(section)
    print("\n" + text)
    full = (args.images, args.gil_images, args.repeats) == (
        FULL_IMAGES,
        FULL_GIL_IMAGES,
        FULL_REPEATS,
    )
    bc.record(args, "decode_gil", HEADER, text, env["venv"], full)
    return 0


if __name__ == "__main__":
    sys.exit(main())
