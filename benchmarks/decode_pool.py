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
forked processes holding the bytes in memory), one pass of it taken just before each timed
pass; a decoding's share of the limit is the median over its passes of the pass's rate /
that limit pass's. This machine's speed changes from second to second (a pass of the
limit alone measured 8,100 and 11,300 images/s a few seconds apart, the CPU time per image
changing with it), so a limit measured once, minutes away from a pass, says more about the
moment than about the data path.

The rank's own work per batch, with processes, at batch sizes 64, 256 and 1,024: the Python
function calls the consuming thread makes per batch (``sys.setprofile``: what grows with
the batch's rows where there is Python per row) and its CPU microseconds per batch
(``time.thread_time``: sending the batch's bytes, copying its tensors out of shared memory).

Targets (issue 44): ``gil`` with 2 processes >= 1.8x 1 process; ``pillow`` (the data path
with Pillow's JPEG decoding) with 2 processes >= 0.8x the decode limit; the rank's calls per
batch not growing with the batch's rows.

    .venv/bin/python benchmarks/decode_pool.py                      # ~3 min on 2 cores
    .venv/bin/python benchmarks/decode_pool.py --quick --no-record  # ~1 min: 512 images
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
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

FULL_IMAGES = 4096
ROW_GROUP = 512
POOLS = (("threads", 1), ("threads", 2), ("processes", 1), ("processes", 2))
CALL_BATCHES = (64, 256, 1024)
TARGET_SCALING, TARGET_DECODE = 1.8, 0.8
HEADER = """\
# Decode pool (benchmarks/decode_pool.py)

Images/s of one rank's data path alone (read, shuffle, decode, collate: no model) on
encoded 128x128 JPEGs, decoded by a `decode_fn` in threads or in worker processes
(`decode_pool`), against the decode limit (Pillow alone on every core); and the rank's own
Python calls and CPU time per batch at several batch sizes. Targets (issue 44): a
`decode_fn` that holds the GIL scales >= 1.8x from 1 to 2 processes; the data path with
Pillow's decoding (`pillow`) in 2 processes >= 0.8x the decode limit; the rank's Python
calls per batch do not grow with the batch's rows. See the script's docstring for how each
number is obtained.

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
    """One shuffled pass of the rank's data path: rows made into batches."""
    loader = open_loader(spec, "train", 1, 0, pin=False)
    sizes = StepPlan(data.rows("train"), 1, 0, spec.batch_size).batch_sizes
    rows = 0
    for chunk, decoded in decoder.ahead(loader.batches(sizes, pass_index), 1):
        rows += Batch(chunk, spec, torch.device("cpu"), None, decoder, 1, decoded).size
    return rows


def rate(spec, data, fn, pool: str, workers: int, repeats: int, limit) -> tuple[float, float]:
    """Images/s of the best of ``repeats`` timed passes (after an untimed one), and the
    median over them of each pass's rate / the decode limit's pass taken just before it
    (``limit``: an ``image_fit.DecodeLimit``)."""
    decoder = make_decoder(spec, data, fn, pool, workers)
    try:
        one_pass(spec, data, decoder, 1)
        best, shares = 0.0, []
        for r in range(repeats):
            limit_s = limit.rate()
            start = time.perf_counter()
            rows = one_pass(spec, data, decoder, r + 2)
            images_s = rows / (time.perf_counter() - start)
            best = max(best, images_s)
            shares.append(images_s / limit_s)
        return best, statistics.median(shares)
    finally:
        decoder.close()


def rank_work(data, store, batch: int) -> tuple[float, float, float]:
    """With 2 processes and ``batch`` rows a batch: the consuming thread's Python calls
    per batch, and its CPU microseconds per batch and per image."""
    spec = bc.loader_only_spec(data, store, batch, decode=DecodeSpec())
    decoder = make_decoder(spec, data, image_fit.decode, "processes", 2)
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1

    try:
        one_pass(spec, data, decoder, 1)
        cpu = time.thread_time()
        sys.setprofile(count)
        try:
            rows = one_pass(spec, data, decoder, 2)
        finally:
            sys.setprofile(None)
        cpu = time.thread_time() - cpu
    finally:
        decoder.close()
    batches = -(-rows // batch)
    return calls / batches, cpu / batches * 1e6, cpu / rows * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    bc.add_pass_args(parser)
    args = parser.parse_args()
    images, repeats = bc.pass_sizes(args, FULL_IMAGES)
    env = bc.machine(("PIL", "simplejpeg"))
    work = Path(tempfile.mkdtemp(prefix="decode-pool-"))
    store = Store.create(str(work / "store"))
    data, blobs = dataset(images, work / "data")
    spec = bc.loader_only_spec(data, store, args.batch, decode=DecodeSpec())
    print(f"{images:,} JPEGs, batch {args.batch}, {os.cpu_count()} cores", flush=True)
    decode_limit = image_fit.DecodeLimit(blobs, os.cpu_count() or 1)  # forked before any thread
    if not bc.wait_quiet(args.quiet_timeout):
        print("(other processes kept the CPUs busy)")
    rates: dict[tuple[str, str, int], float] = {}
    shares: dict[tuple[str, str, int], float] = {}
    try:
        for name, fn in DECODINGS.items():
            for pool, workers in POOLS:
                bc.wait_quiet(args.quiet_timeout)
                key = (name, pool, workers)
                rates[key], shares[key] = rate(spec, data, fn, pool, workers, repeats, decode_limit)
                print(
                    f"{name:8s} {pool:9s} x{workers}: {rates[key]:,.0f} images/s, "
                    f"{shares[key]:.2f} of the decode limit",
                    flush=True,
                )
    finally:
        decode_limit.close()
    limit = max(decode_limit.passes)
    spread = min(decode_limit.passes) / limit
    print(f"decode limit (decode_image, {os.cpu_count()} processes): {limit:,.0f} images/s")
    calls = {b: rank_work(data, store, b) for b in CALL_BATCHES}
    for b, (per_batch, cpu_batch, _) in calls.items():
        print(f"batch {b}: {per_batch:.0f} Python calls, {cpu_batch:,.0f} us CPU a batch")
    lines = [
        f"## {env['date']}, stack `{env['venv']}`",
        "",
        *bc.machine_lines(env, ("PIL", "simplejpeg")),
        f"- Job: {images:,} JPEGs 128x128, batch {args.batch}, one rank, shuffled; best of "
        f"{repeats} pass(es) after an untimed one",
        f"- Decode limit (`decode_image`, {os.cpu_count()} processes): **{limit:,.0f} "
        f"images/s**, the best of {len(decode_limit.passes)} passes, one before each timed pass "
        f"(the slowest {spread:.2f} of it: the machine's speed varies from second to second, "
        "so each pass is compared with the limit's pass beside it)",
        "",
        "| decode_fn | " + " | ".join(f"{p} x{w}" for p, w in POOLS) + " |",
        "|---|" + "---:|" * len(POOLS),
    ]
    for name in DECODINGS:
        cells = " | ".join(f"{rates[name, p, w]:,.0f}" for p, w in POOLS)
        lines.append(f"| {name} | {cells} |")
    gil_scaling = rates["gil", "processes", 2] / rates["gil", "processes", 1]
    thread_scaling = rates["gil", "threads", 2] / rates["gil", "threads", 1]
    pillow_share = shares["pillow", "processes", 2]
    met = lambda ok: "met" if ok else "MISSED"  # noqa: E731
    share = lambda name, pool: shares[name, pool, 2]  # noqa: E731
    lines += [
        "",
        f"- `gil`: 2 processes / 1 process **{gil_scaling:.3f}** (target >= {TARGET_SCALING}: "
        f"{met(gil_scaling >= TARGET_SCALING)}); 2 threads / 1 thread {thread_scaling:.2f}",
        f"- `pillow`: 2 processes / decode limit **{pillow_share:.2f}** (target >= "
        f"{TARGET_DECODE}: {met(pillow_share >= TARGET_DECODE)}); 2 threads / decode limit "
        f"{share('pillow', 'threads'):.2f}",
        f"- `pillow+aug`: 2 processes / decode limit {share('pillow+aug', 'processes'):.2f}, "
        f"2 threads {share('pillow+aug', 'threads'):.2f}",
        f"- `default`: 2 processes / decode limit {share('default', 'processes'):.2f}, 2 "
        f"threads {share('default', 'threads'):.2f}",
        "",
        "| batch rows (2 processes, `pillow+aug`) | the rank's Python calls a batch "
        "| its CPU us a batch | a row |",
        "|---:|---:|---:|---:|",
    ]
    for b, (per_batch, cpu_batch, cpu_image) in calls.items():
        lines.append(f"| {b} | {per_batch:.0f} | {cpu_batch:,.0f} | {cpu_image:.1f} |")
    section = "\n".join(lines) + "\n"
    print(section)
    bc.record(args, "decode_pool", HEADER, section, env["venv"], images == FULL_IMAGES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
