"""Images/s of one rank's data path alone (read, shuffle, decode, collate; no model) with
its decoding in threads or in worker processes (``decode_pool``), and what the rank itself
spends per batch.

A hand-run benchmark, not a test (issue 44). The data: ``--images`` (4,096) encoded
128x128 RGB JPEGs of ``image_fit.make_image`` (generated once into a cache folder), with
their path and label, written to one Parquet file (row groups of 512 rows) and read as a
fit's dataset: one rank, the whole split, shuffled (the default buffer), batches of
``--batch`` (128) rows, each made as a training step gets it (``Decoder.ahead`` then
``Batch``, on the CPU). Three decodings, each the rows' ``decode_fn``:

- ``gil``: Pillow's ``decode_image`` and a pure-Python loop over the JPEG's bytes that holds
  the GIL (about 0.5 ms a row, more than the decoding): where threads cannot scale;
- ``pillow``: ``decode_image`` alone (Pillow), the data path's own cost around the decode
  limit's decoding;
- ``pillow+aug``: ``image_fit.decode`` (``decode_image``, a random 112x112 crop and a
  flip, the row's generator), what a user writes;
- ``default``: no ``decode_fn`` (the default decoding of a binary column:
  ``decoding.decode_images``, simplejpeg into one buffer).

Each with threads (1 and 2) and worker processes (1 and 2): images/s of a whole pass, the
best of ``--repeats`` passes, after one untimed pass (which starts the processes). Against
the decode limit: Pillow's ``decode_image`` alone on every core (``image_fit.DecodeLimit``:
processes forked from this one, holding the bytes in memory), one pass of it taken just
before each timed pass; a decoding's share of the limit is the median over its passes of
the pass's rate / that limit pass's.

That limit runs in other processes than the data path's, and Pillow's JPEG decoding is not
as fast in every process: it decodes a JPEG a line at a time into a line buffer of its own
(``calloc``) and copies each line into the image (``ImagingJpegDecode``), and that copy is
fast or slow by where the buffer lies (on this machine a 128x128 JPEG loads in about 140 us
with the buffer 0 or 32 bytes past a 64-byte boundary, 185 us at 48 and 240 us at 16: the
copy is the difference, 0.6% of the time or 25-40%). The buffer lies where the process's
heap puts it, the same image after image, so a process keeps its speed and the processes
forked from it (the limit's) share it: the limit and the decode workers are two draws, and
the same code (d56f903) read 0.63 and 0.98 of the limit in two runs. So ``pillow`` is also
measured against the decode limit in its own processes: it times its own decoding
(``SelfTimed``: the CPU time of each ``decode_image`` call, in the workers, during the
pass), and its share of that is the pass's rate / the rate its workers would reach doing
nothing but that decoding (the workers / the CPU seconds an image took them). The target is
judged on that share; the decode-limit share is printed beside it.

The rank's own work per batch, with processes, at batch sizes 64, 256 and 1,024: the Python
function calls the consuming thread makes per batch (``sys.setprofile``: what grows with
the batch's rows where there is Python per row), its CPU microseconds per batch
(``time.thread_time``) and the whole rank process's (``time.process_time``: every thread of
it, the workers not counted: sending the batches, taking them out of shared memory, making
them a batch). With it, the decode workers' memory (``/proc/PID/smaps``, as a worker reads
its own: ``read_memory``): private USS at rest (started, before their first batch: what a
worker costs of its own) and after the pass (with what it decoded), the slots' shared memory
left out of USS; proportional PSS and resident RSS after the pass; and their start: the
seconds from the pool's start until each was ready.

Targets: issue 44: ``gil`` with 2 processes >= 1.8x 1 process; ``pillow`` (the data path
with Pillow's JPEG decoding) with 2 processes >= 0.8x the decode limit; the rank's calls
per batch not growing with the batch's rows. Issue 49: ``pillow`` with 2 processes >= 0.95x
the decode limit (in its own processes, above); the rank's CPU a batch <= 0.5x the code
before it; a worker's median USS at rest <= 40 MiB, each worker ready <= 0.2 s after the
first. ``--shm-mib 64`` runs the whole benchmark in a private mount namespace whose
``/dev/shm`` is a tmpfs of 64 MiB (a container's; needs root and ``unshare``), recorded as
a section of its own.

    .venv/bin/python benchmarks/decode_pool.py                      # ~4 min on 2 cores
    .venv/bin/python benchmarks/decode_pool.py --quick --no-record  # ~1 min: 512 images
    .venv/bin/python benchmarks/decode_pool.py --only pillow --batch 512 --shm-mib 64
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402
import image_fit  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

from spark_estimator import Store  # noqa: E402
from spark_estimator.decoding import decode_image  # noqa: E402
from spark_estimator.shared.serialization import pack_functions  # noqa: E402
from spark_estimator.shared.spec import ColumnSpec, DatasetInfo, DecodeSpec  # noqa: E402
from spark_estimator.worker.data.batch import Batch  # noqa: E402
from spark_estimator.worker.data.loader import first_rows, open_loader  # noqa: E402
from spark_estimator.worker.data.shards import StepPlan  # noqa: E402
from spark_estimator.worker.decode.decoder import Decoder  # noqa: E402
from spark_estimator.worker.decode.worker_process import read_memory  # noqa: E402

FULL_IMAGES = 4096
ROW_GROUP = 512
POOLS = (("threads", 1), ("threads", 2), ("processes", 1), ("processes", 2))
CALL_BATCHES = (64, 256, 1024)
TARGET_SCALING, TARGET_DECODE, TARGET_DECODE_49 = 1.8, 0.8, 0.95
TARGET_USS_MIB, TARGET_START_S = 40, 0.2
SHM_ENV = "DECODE_POOL_SHM_MIB"  # set inside the namespace run (--shm-mib)
HEADER = """\
# Decode pool (benchmarks/decode_pool.py)

Images/s of one rank's data path alone (read, shuffle, decode, collate: no model) on
encoded 128x128 JPEGs, decoded by a `decode_fn` in threads or in worker processes
(`decode_pool`), against the decode limit (Pillow alone on every core); and the rank's own
Python calls and CPU time per batch at several batch sizes, the decode workers' memory and
start. Targets (issue 44): a `decode_fn` that holds the GIL scales >= 1.8x from 1 to 2
processes; the data path with Pillow's decoding (`pillow`) in 2 processes >= 0.8x the
decode limit; the rank's Python calls per batch do not grow with the batch's rows. Issue
49: `pillow` >= 0.95x the decode limit in its own processes (Pillow's speed differs from
process to process: see the docstring); the rank's CPU a batch <= 0.5x the code before it;
a worker's median USS at rest <= 40 MiB; each worker ready <= 0.2 s after the first. See
the script's docstring for how each number is obtained.

    .venv/bin/python benchmarks/decode_pool.py [--images N] [--repeats R]
"""


def gil(row: dict, augment) -> dict:
    """Pillow's decoding, and a pure-Python loop over the bytes (holds the GIL)."""
    data = row["content"]
    checksum = 0
    for i in range(0, min(len(data), 8000), 2):
        checksum = (checksum + data[i] * i) % 65521
    image = decode_image(data)
    return {"content": image[:, :112, :112] if checksum >= 0 else image}


def pillow(row: dict, augment) -> dict:
    """Pillow's ``decode_image``, nothing else."""
    return {"content": decode_image(row["content"])}


DECODINGS = {"gil": gil, "pillow": pillow, "pillow+aug": image_fit.decode, "default": None}


def dataset(images: int, root: Path) -> tuple[DatasetInfo, list[bytes]]:
    """The JPEGs as one Parquet file of content, path and label, described as a fit's
    dataset (one split), and their bytes."""
    files = image_fit.image_files(image_fit.image_folder(images, bc.DATA))
    blobs = [Path(p).read_bytes() for p, _ in files]
    folder = root / "train"
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "content": pa.array(blobs, pa.binary()),
            "path": [f"file:{p}" for p, _ in files],
            "label": pa.array([label for _, label in files], pa.int64()),
        }
    )
    path = folder / "part-00000.parquet"
    pq.write_table(table, path, row_group_size=ROW_GROUP)
    meta = pq.ParquetFile(path).metadata
    groups = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    data = DatasetInfo(
        path=str(root),
        features=[ColumnSpec("content", "binary", "float32")],
        labels=[ColumnSpec("label", "scalar", "int64")],
        files={"train": [(f"train/{path.name}", groups)]},
        row_names="path",
    )
    return data, blobs


def make_decoder(spec, data, fn, pool: str, workers: int) -> Decoder:
    decode = DecodeSpec(functions=pack_functions(decode_fn=fn), pool=pool, workers=workers)
    decoder = Decoder(
        decode, data.columns, {"label"}, 0, data.row_names, batch_rows=spec.batch_size
    )
    decoder.prime(first_rows(spec, "train"))
    return decoder


def one_pass(spec, data, decoder: Decoder, pass_index: int) -> int:
    """One shuffled pass of the rank's data path: rows made into batches (the chunks
    handed to the decoder's ``share`` as a fit's loader does)."""
    loader = open_loader(spec, "train", 1, 0, pin=False, share=getattr(decoder, "share", None))
    sizes = StepPlan(data.rows("train"), 1, 0, spec.batch_size).batch_sizes
    rows = 0
    for chunk, decoded in decoder.ahead(loader.batches(sizes, pass_index), 1):
        rows += Batch(chunk, spec, torch.device("cpu"), None, decoder, 1, decoded).size
    return rows


class SelfTimed:
    """A ``decode_fn`` that times itself: ``fn`` as it is, and the CPU seconds of the
    thread that ran it added to a total that each process it runs in keeps in a file of
    its own in ``folder`` (8 bytes, rewritten in place after each row, outside the time
    taken), so that ``seconds()`` tells how long the decoding itself took where it ran: in
    the decode workers' own processes, at the moment of the pass."""

    def __init__(self, fn, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.__setstate__({"fn": fn, "folder": folder})

    def __getstate__(self) -> dict:
        return {"fn": self.fn, "folder": self.folder}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.fd, self.total, self.lock = None, 0.0, threading.Lock()

    def __call__(self, row: dict, augment) -> dict:
        start = time.thread_time()
        out = self.fn(row, augment)
        took = time.thread_time() - start
        with self.lock:
            if self.fd is None:
                path = self.folder / str(os.getpid())
                self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            self.total += took
            os.pwrite(self.fd, struct.pack("d", self.total), 0)
        return out

    def seconds(self) -> float:
        """The seconds taken so far, summed over the processes."""
        return sum(struct.unpack("d", p.read_bytes())[0] for p in self.folder.iterdir())


def rate(spec, data, fn, pool: str, workers: int, repeats: int, limit) -> dict:
    """Images/s of the best of ``repeats`` timed passes (after an untimed one, ``best``),
    and the median over them of each pass's rate / the decode limit's pass taken just
    before it (``limit``: an ``image_fit.DecodeLimit``; ``share``). With ``fn`` a
    ``SelfTimed``, also the median of each pass's rate / the rate its ``workers`` would
    reach doing nothing but its decoding, at the CPU time an image took them in the pass
    (``own``: the decode limit in the data path's own processes)."""
    decoder = make_decoder(spec, data, fn, pool, workers)
    timed = isinstance(fn, SelfTimed)
    try:
        one_pass(spec, data, decoder, 1)
        best, shares, own = 0.0, [], []
        for r in range(repeats):
            limit_s = limit.rate()
            took = fn.seconds() if timed else 0.0
            start = time.perf_counter()
            rows = one_pass(spec, data, decoder, r + 2)
            images_s = rows / (time.perf_counter() - start)
            best = max(best, images_s)
            shares.append(images_s / limit_s)
            if timed:
                own.append(images_s * (fn.seconds() - took) / rows / workers)
        return {
            "best": best,
            "share": statistics.median(shares),
            "own": statistics.median(own) if own else None,
        }
    finally:
        decoder.close()


def rank_work(data, store, batch: int) -> dict:
    """With 2 processes and ``batch`` rows a batch (``pillow+aug``): the consuming thread's
    Python calls and CPU microseconds per batch, the rank process's CPU microseconds per
    batch and per image, and the workers' memory and start (``worker_facts``)."""
    spec = bc.loader_only_spec(data, store, batch, decode=DecodeSpec())
    decoder = make_decoder(spec, data, image_fit.decode, "processes", 2)
    at_rest = worker_facts(decoder)["uss"]
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1

    try:
        one_pass(spec, data, decoder, 1)
        thread, process = time.thread_time(), time.process_time()
        sys.setprofile(count)
        try:
            rows = one_pass(spec, data, decoder, 2)
        finally:
            sys.setprofile(None)
        thread, process = time.thread_time() - thread, time.process_time() - process
        facts = worker_facts(decoder)
    finally:
        decoder.close()
    batches = -(-rows // batch)
    return {
        "calls": calls / batches,
        "thread_us": thread / batches * 1e6,
        "rank_us": process / batches * 1e6,
        "rank_us_image": process / rows * 1e6,
        **facts,
        "rest_uss": at_rest,
    }


def worker_facts(decoder: Decoder) -> dict:
    """The decode workers' memory now (MiB: USS without the slots they share with the rank,
    PSS, RSS each, as a worker reads its own: ``read_memory``) and their start seconds (the
    summary's, where the pool reports them)."""
    pool = decoder.processes
    workers = pool.processes.workers.values() if hasattr(pool, "processes") else pool.workers
    memory = [read_memory(w.pid) for w in workers]
    return {
        "uss": [m["uss"] / 2**20 for m in memory],
        "pss": [m["pss"] / 2**20 for m in memory],
        "rss": [m["rss"] / 2**20 for m in memory],
        "start": decoder.summary().get("worker_start_seconds", []),
    }


def in_small_shm(args) -> int | None:
    """With ``--shm-mib N`` (outside the namespace): this benchmark run again in a private
    mount namespace whose /dev/shm is a tmpfs of N MiB; its exit status."""
    if not args.shm_mib or os.environ.get(SHM_ENV):
        return None
    command = f"mount -t tmpfs -o size={args.shm_mib}m tmpfs /dev/shm && exec " + shlex.join(
        [sys.executable, *sys.argv]
    )
    env = dict(os.environ, **{SHM_ENV: str(args.shm_mib)})
    return subprocess.run(["unshare", "-m", "sh", "-c", command], env=env).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--only", default=",".join(DECODINGS), help="decodings, comma-separated")
    parser.add_argument("--shm-mib", type=int, default=None, help="/dev/shm's size (root)")
    bc.add_pass_args(parser)
    args = parser.parse_args()
    again = in_small_shm(args)
    if again is not None:
        return again
    only = args.only.split(",")
    shm = os.environ.get(SHM_ENV)
    images, repeats = bc.pass_sizes(args, FULL_IMAGES)
    env = bc.machine(("PIL", "simplejpeg"))
    scratch = Path(tempfile.mkdtemp(prefix="decode-pool-"))  # the data and the store
    try:
        return measure(args, only, shm, images, repeats, env, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def measure(args, only: list[str], shm, images: int, repeats: int, env: dict, scratch: Path):
    """The whole benchmark, with its data and store in ``scratch``; its results recorded."""
    store = Store.create(str(scratch / "store"))
    data, blobs = dataset(images, scratch / "data")
    spec = bc.loader_only_spec(data, store, args.batch, decode=DecodeSpec())
    print(f"{images:,} JPEGs, batch {args.batch}, {os.cpu_count()} cores", flush=True)
    decode_limit = image_fit.DecodeLimit(blobs, os.cpu_count() or 1)  # forked before any thread
    if not bc.wait_quiet(args.quiet_timeout):
        print("(other processes kept the CPUs busy)")
    passes: dict[tuple[str, str, int], dict] = {}
    try:
        for name, fn in DECODINGS.items():
            if name not in only:
                continue
            for pool, workers in POOLS:
                bc.wait_quiet(args.quiet_timeout)
                key = (name, pool, workers)
                decode_fn = fn
                if name == "pillow":  # timed: its decode limit in its own processes too
                    decode_fn = SelfTimed(fn, scratch / f"timed-{pool}-{workers}")
                passes[key] = rate(spec, data, decode_fn, pool, workers, repeats, decode_limit)
                own = passes[key]["own"]
                print(
                    f"{name:8s} {pool:9s} x{workers}: {passes[key]['best']:,.0f} images/s, "
                    f"{passes[key]['share']:.2f} of the decode limit"
                    + (f", {own:.2f} of its own" if own is not None else ""),
                    flush=True,
                )
    finally:
        decode_limit.close()
    limit = max(decode_limit.passes)
    spread = min(decode_limit.passes) / limit
    print(f"decode limit (decode_image, {os.cpu_count()} processes): {limit:,.0f} images/s")
    work = {b: rank_work(data, store, b) for b in CALL_BATCHES} if "pillow+aug" in only else {}
    for b, found in work.items():
        print(
            f"batch {b}: {found['calls']:.0f} Python calls, {found['thread_us']:,.0f} us CPU "
            f"of the consuming thread, {found['rank_us']:,.0f} us of the rank a batch; workers "
            f"USS {found['uss']} MiB, started at {found['start']} s"
        )
    lines = [
        f"## {env['date']}, stack `{env['venv']}`" + (f", /dev/shm {shm} MiB" if shm else ""),
        "",
        *bc.machine_lines(env, ("PIL", "simplejpeg")),
        f"- Job: {images:,} JPEGs 128x128, batch {args.batch}, one rank, shuffled; best of "
        f"{repeats} pass(es) after an untimed one"
        + (f"; in a mount namespace whose /dev/shm is a tmpfs of {shm} MiB" if shm else ""),
        f"- Decode limit (`decode_image`, {os.cpu_count()} processes): **{limit:,.0f} "
        f"images/s**, the best of {len(decode_limit.passes)} passes, one before each timed pass "
        f"(the slowest {spread:.2f} of it: the machine's speed varies from second to second, "
        "so each pass is compared with the limit's pass beside it)",
        "",
        "| decode_fn | " + " | ".join(f"{p} x{w}" for p, w in POOLS) + " |",
        "|---|" + "---:|" * len(POOLS),
    ]
    for name in (n for n in DECODINGS if n in only):
        cells = " | ".join(f"{passes[name, p, w]['best']:,.0f}" for p, w in POOLS)
        lines.append(f"| {name} | {cells} |")
    met = lambda ok: "met" if ok else "MISSED"  # noqa: E731
    share = lambda name, pool, of="share": passes[name, pool, 2][of]  # noqa: E731
    lines.append("")
    if "gil" in only:
        gil_scaling = passes["gil", "processes", 2]["best"] / passes["gil", "processes", 1]["best"]
        thread_scaling = passes["gil", "threads", 2]["best"] / passes["gil", "threads", 1]["best"]
        lines.append(
            f"- `gil`: 2 processes / 1 process **{gil_scaling:.3f}** (target >= "
            f"{TARGET_SCALING}: {met(gil_scaling >= TARGET_SCALING)}); 2 threads / 1 thread "
            f"{thread_scaling:.2f}"
        )
    if "pillow" in only:
        pillow_own = share("pillow", "processes", "own")
        lines.append(
            f"- `pillow`: 2 processes / the decode limit in their own processes **"
            f"{pillow_own:.2f}** (target >= {TARGET_DECODE_49}: "
            f"{met(pillow_own >= TARGET_DECODE_49)}); 2 processes / the decode limit "
            f"{share('pillow', 'processes'):.2f} (another process's Pillow: see the "
            f"docstring); 2 threads / decode limit {share('pillow', 'threads'):.2f}, / their "
            f"own {share('pillow', 'threads', 'own'):.2f}"
        )
    for name in ("pillow+aug", "default"):
        if name in only:
            lines.append(
                f"- `{name}`: 2 processes / decode limit {share(name, 'processes'):.2f}, 2 "
                f"threads {share(name, 'threads'):.2f}"
            )
    if work:
        lines += [
            "",
            "| batch rows (2 processes, `pillow+aug`) | the consuming thread's Python calls a "
            "batch | its CPU us a batch | the rank's CPU us a batch | a row | workers' USS at "
            "rest MiB | after the pass: USS / PSS / RSS MiB | workers ready at (s) |",
            "|---:|---:|---:|---:|---:|---|---|---|",
        ]
        for b, f in work.items():
            memory = " / ".join(", ".join(f"{v:.0f}" for v in f[k]) for k in ("uss", "pss", "rss"))
            start = ", ".join(f"{v:.2f}" for v in f["start"]) or "-"
            rest = ", ".join(f"{v:.0f}" for v in f["rest_uss"])
            lines.append(
                f"| {b} | {f['calls']:.0f} | {f['thread_us']:,.0f} | {f['rank_us']:,.0f} | "
                f"{f['rank_us_image']:.1f} | {rest} | {memory} | {start} |"
            )
        uss = statistics.median(v for f in work.values() for v in f["rest_uss"])
        starts = [f["start"] for f in work.values() if f["start"]]
        after = max((max(s) - min(s) for s in starts), default=None)
        lines.append(
            f"- workers' median USS at rest (started, before their first batch) **{uss:.0f} "
            f"MiB** (target <= {TARGET_USS_MIB}: {met(uss <= TARGET_USS_MIB)}); after a pass "
            "they also hold what they decoded (the rows' results before they are stacked "
            "into the slot, which is left out: the rank maps it too)"
            + (
                f"; the last worker ready at most **{after:.2f} s** after the first (target "
                f"<= {TARGET_START_S}: {met(after <= TARGET_START_S)})"
                if after is not None
                else ""
            )
        )
    section = "\n".join(lines) + "\n"
    print(section)
    key = env["venv"] + (f" shm-{shm}" if shm else "")
    key += "" if only == list(DECODINGS) else f" {args.only}"
    bc.record(args, "decode_pool", HEADER, section, key, images == FULL_IMAGES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
