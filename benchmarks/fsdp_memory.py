"""Per-rank memory and step time of ``parallelism="fsdp"`` against DDP (issue 29).

A hand-run benchmark, not a test. The model: a transformer-like stack built by a model
function on ``torch.device("meta")`` (each rank materializes what it holds): a Linear input
projection of 16 float features per token and a learned position embedding (16 tokens),
``--layers`` pre-norm blocks of width ``--width`` (LayerNorm, attention with a fused
qkv Linear and torch's ``scaled_dot_product_attention``, an output Linear, LayerNorm, a
4x-wide MLP with GELU), a final LayerNorm and a Linear head on the mean over the tokens;
302 M parameters at the full size (1024 wide, 24 blocks). Adam (lr 1e-4) given as a
function ``model -> Adam``, MSE, batch 2 per rank, ``--steps`` steps per epoch, 2 epochs,
CPU (gloo), ``spark.task.cpus`` 1 (one torch thread per rank). The data: ranks x batch x
steps synthetic rows (fixed numpy seed) of 256 float32 features (16 tokens x 16) and a
float32 label, made with ``createDataFrame``. Activations are kept small (32 tokens per
rank per step) so that parameters, gradients and Adam's state dominate memory.

Each configuration is one real ``TorchEstimator(parallelism=..., fsdp_wrap=[Block] for FSDP,
model=<function on meta>, optimizer=<function>, max_restarts=0).fit(df)`` on ``local[N]``
(N ranks: 2 and 4), in a Spark session with ``spark.python.worker.reuse=false``: every
rank runs in a newly forked Python worker, so each process's peak memory is its own fit's
(a reused worker would carry the peak of an earlier fit). Every number per rank:

- baseline RSS: the rank's resident set (``VmRSS`` in ``/proc/self/status``) when the
  model function is called, i.e. before the model is built: the Python worker, torch,
  spark_estimator, the process group. The function passes it on in an environment
  variable of the process.
- training peak RSS: ``ru_maxrss`` (``getrusage(RUSAGE_SELF)``, the measure of the
  library's ``rank_memory``) read by a callback in ``on_epoch_end`` of epoch 1, which the
  loop calls after the epoch's steps and before the epoch's checkpoint is written; the
  callback all-gathers every rank's values and adds them to the epoch's history record.
  It covers setup (model built and sharded or wrapped in DDP, optimizer), the data loader
  and the epoch's steps, the first with Adam's state allocated.
- training memory: training peak RSS - baseline RSS (what the model, its gradients, DDP's
  buckets or FSDP's gathered units, Adam's state and the activations added).
- fit peak RSS: the library's own ``getTrainingSummary()["rank_memory"][r]["peak_memory_mib"]``
  (``ru_maxrss`` when the rank returns): the whole fit, so also the epochs' checkpoints
  (DDP: rank 0 serializes model and Adam state into one file; FSDP: every rank writes its
  shard) and, on rank 0, the result (FSDP: the whole model gathered to rank 0 first).
- parameter elements: ``rank_memory``'s ``parameter_elements`` (FSDP: the rank's shards).
- virtual overhead: ``VmPeak - VmHWM`` at the callback (address space beyond the resident
  peak: libraries, thread stacks, malloc arenas), what a limit on the address space must
  leave room for.

Step seconds: ``getHistory()[e]["seconds"]["train"]`` (each rank's time in the epoch's
training pass) divided by the batches the rank ran that epoch (``ranks.json``), the slowest
rank; the last epoch (2) is the steady state (epoch 1 includes the first step: Adam's state and
FSDP's lazy setup). Fit wall: the ``fit`` call from the driver, checkpoints included. With
4 ranks on a 2-core machine the ranks time-share the cores: 4-rank step times are not
scaling numbers.

Before each fit the script estimates the memory all its ranks need at once (per rank: the
baseline plus, per parameter, DDP 20 bytes: weight, gradient, DDP bucket, Adam's two
moments; FSDP 16 / N bytes; plus rank 0's peak over that at the checkpoint or the result:
DDP 12 bytes per parameter, FSDP 8) and skips the configuration, saying so, when that
exceeds the machine's ``MemAvailable`` less ``--margin-gib``: the machine has no swap, so
the alternative is the kernel's OOM killer. Activations per rank: the bytes of the tensors
autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``, parameters not
counted) in one forward of one block at the batch's shape, times the blocks, plus the
model without blocks; measured in the driver.

Targets (issue 29): (1) FSDP training memory at N ranks <= 1.3 x (DDP's / N) + activations,
DDP's per rank being the same at every N (every rank holds everything): where DDP at N
ranks does not fit the machine, DDP's at 2 ranks is used, and the table says so; (2) FSDP
step time at 2 ranks <= 1.5 x DDP's; (3) a per-rank memory limit under which DDP cannot
train the model and FSDP does. The limit is ``spark.executor.pyspark.memory``: Spark passes
it to each Python worker (``PYSPARK_EXECUTOR_MEMORY_MB``; checked: also in local mode, each
worker getting the whole value, as the ranks report), which sets it as ``RLIMIT_AS``, a
limit on the address space, not on resident memory; allocations beyond it fail in the
process that makes them. Unless ``--limit-gib`` sets it, the limit is taken halfway between
what FSDP at the largest N needed (its largest fit peak RSS plus the largest virtual
overhead) and what DDP needed for training alone (its smallest training peak RSS plus the
same overhead), both measured above, and is skipped when they are less than 0.5 GiB apart.
Under it, in a new Spark session, fits of 1 epoch of 2 steps (the peaks come at the
first step, Adam's state made, and at the epoch's checkpoint and the result, which such a
fit has too): DDP at the smallest N (each rank can grow to the limit, so at most N x limit;
DDP's per-rank memory does not depend on N), then FSDP at the largest N. Results are
printed and written to ``benchmarks/results/fsdp_memory.md`` (a run smaller than the full
size writes to a temporary folder; ``--no-record``: nothing).

Run from the repository root (full size: about 25 minutes on a 2-core machine, and about
17 GiB of free memory for DDP's 2 ranks; DDP's 4 ranks need about 29 GiB)::

    .venv/bin/python benchmarks/fsdp_memory.py
    .venv/bin/python benchmarks/fsdp_memory.py --width 64 --layers 2 --no-limit --no-record  # quick
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from spark_estimator.callbacks import Callback  # noqa: E402

NAME = "fsdp_memory"
MEMORY_TARGET = 1.3  # FSDP training memory <= 1.3 x DDP's / N + activations
TIME_TARGET = 1.5  # FSDP step time at 2 ranks <= 1.5 x DDP's
LIMIT_GAP_GIB = 0.5  # the least room between FSDP's and DDP's needs to place a limit in
BASELINE_ENV = "SPARK_ESTIMATOR_BENCH_BASELINE"
GIB, MIB = 2**30, 2**20
# per parameter, float32 (see the docstring): what each rank holds while training
TRAIN_BYTES = {"ddp": 20.0, "fsdp": 16.0}  # FSDP's is divided by the ranks
RANK0_EXTRA_BYTES = {"ddp": 12.0, "fsdp": 8.0}  # rank 0's checkpoint / result on top
HEADER = """\
# FSDP memory and step time (benchmarks/fsdp_memory.py)

Per-rank peak memory (CPU resident set) and step time of a 302 M-parameter transformer-like
model (24 blocks, width 1024) with Adam, trained by `TorchEstimator` with
`parallelism="ddp"` and `"fsdp"` (`fsdp_wrap=[Block]`, the model a function built on
`torch.device("meta")`) at 2 and 4 ranks (`local[N]`, CPU, gloo, one torch thread per rank),
batch 2 x 16 tokens per rank, 2 epochs of 3 steps; then a per-rank memory limit
(`spark.executor.pyspark.memory`, which Spark sets as `RLIMIT_AS` in the Python workers)
under which DDP cannot train the model and FSDP does. Targets (issue 29): FSDP's training
memory at N ranks <= 1.3 x (DDP's / N) + activations; FSDP's step time at 2 ranks <= 1.5 x
DDP's; the limit demonstration. See the script's docstring for how each number is taken.

    .venv/bin/python benchmarks/fsdp_memory.py [--width W --layers L --steps S --ranks 2,4]

Each run replaces the section of its stack below and keeps the others.
"""


# -- the model ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    width: int = 1024
    layers: int = 24
    heads: int = 16
    tokens: int = 16
    features: int = 16  # float features per token
    batch: int = 2  # rows per rank per step
    steps: int = 3  # steps per epoch
    epochs: int = 2


FULL = Config()


class Block(torch.nn.Module):
    """A pre-norm transformer block: attention (fused qkv) and a 4x MLP, each residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)
        self.norm2 = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).unbind(2)
        a = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        )
        x = x + self.out(a.transpose(1, 2).reshape(b, t, w))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class Net(torch.nn.Module):
    """Tokens of float features -> input projection + positions -> blocks -> mean -> 1."""

    def __init__(self, width: int, layers: int, heads: int, tokens: int, features: int):
        super().__init__()
        self.tokens, self.features = tokens, features
        self.inp = torch.nn.Linear(features, width)
        self.pos = torch.nn.Embedding(tokens, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        x = self.inp(x.view(-1, self.tokens, self.features))
        x = x + self.pos.weight
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


def net(config: Config) -> Net:
    return Net(config.width, config.layers, config.heads, config.tokens, config.features)


def parameters(config: Config) -> int:
    """The model's parameter elements (counted on meta: no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in net(config).parameters())


def model_function(config: Config):
    """The ``model`` given to the estimator: builds the model on meta, after noting this
    process's resident set (the baseline: nothing of the model exists yet)."""

    def build():
        os.environ[BASELINE_ENV] = json.dumps({"pid": os.getpid(), "rss": proc_status()["VmRSS"]})
        with torch.device("meta"):
            return net(config)

    return build


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-4)


def activation_bytes(config: Config) -> int:
    """Bytes autograd saves for backward in one rank's forward (parameters not counted):
    one block at the batch's shape x the blocks, plus the model without blocks."""

    def saved(module: torch.nn.Module, x: torch.Tensor) -> int:
        params = {p.data_ptr() for p in module.parameters()}
        storages: dict[int, int] = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                storages[ptr] = max(storages.get(ptr, 0), t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(x).sum()
        return sum(storages.values())

    torch.manual_seed(0)
    rows = config.batch
    block = Block(config.width, config.heads)
    x = torch.randn(rows, config.tokens, config.width, requires_grad=True)
    outer = net(replace(config, layers=0))
    inputs = torch.randn(rows, config.tokens * config.features)
    return config.layers * saved(block, x) + saved(outer, inputs)


# -- measured in the ranks -----------------------------------------------------------------------
def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, VmPeak, VmSize of this process in bytes (/proc/self/status)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "VmPeak", "VmSize"):
                out[key] = int(value.split()[0]) * 1024
    return out


class MemoryProbe(Callback):
    """At each epoch's end (after its steps, before its checkpoint) every rank's memory,
    all-gathered, into the epoch's record as ``bench_memory`` (a list in rank order)."""

    def on_epoch_end(self, epoch, logs, state):
        import torch.distributed as dist

        status = proc_status()
        baseline = json.loads(os.environ.get(BASELINE_ENV, "{}"))
        mine = {
            "rank": state.rank,
            "pid": os.getpid(),
            "baseline_rss": baseline.get("rss") if baseline.get("pid") == os.getpid() else None,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "rss": status["VmRSS"],
            "vm_peak": status["VmPeak"],
            "vm_hwm": status["VmHWM"],
            "rlimit_as": resource.getrlimit(resource.RLIMIT_AS)[0],
        }
        gathered = [None] * state.world_size
        dist.all_gather_object(gathered, mine)
        logs["bench_memory"] = gathered


# -- the fits ------------------------------------------------------------------------------------
def frame(spark, config: Config, ranks: int):
    """ranks x batch x steps rows: ``x`` (tokens x features float32), ``y`` (float32)."""
    import pandas as pd

    rows = ranks * config.batch * config.steps
    rng = np.random.default_rng([bc.SEED, ranks])
    x = rng.standard_normal((rows, config.tokens * config.features), dtype=np.float32)
    y = x[:, :8].sum(axis=1) / np.float32(8**0.5)
    return spark.createDataFrame(pd.DataFrame({"x": list(x), "y": y}))


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def needed_bytes(params: int, ranks: int, parallelism: str, baseline: float) -> float:
    """What all ranks of one fit hold at once, at most (see the docstring)."""
    per_param = TRAIN_BYTES[parallelism] / (ranks if parallelism == "fsdp" else 1)
    return ranks * (baseline + per_param * params) + RANK0_EXTRA_BYTES[parallelism] * params


def fits(params: int, ranks: int, parallelism: str, baseline: float, margin: float) -> str | None:
    """Why a fit would not fit the machine's available memory now (None: it fits)."""
    need, free = needed_bytes(params, ranks, parallelism, baseline), available_bytes()
    if need > free - margin:
        return (
            f"needs about {need / GIB:.1f} GiB for its {ranks} ranks; "
            f"{free / GIB:.1f} GiB available less a {margin / GIB:.1f} GiB margin"
        )
    return None


def run_fit(spark, config: Config, parallelism: str, ranks: int, store_dir: str) -> dict:
    """One fit; its per-rank memory and step times, or the error it failed with."""
    from spark_estimator import Store, TorchEstimator

    df = frame(spark, config, ranks)
    folder = tempfile.mkdtemp(prefix="fsdp-memory-store-", dir=store_dir)
    store = Store.create(folder)
    est = TorchEstimator(
        model=model_function(config),
        optimizer=adam,
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["y"],
        num_proc=ranks,
        batch_size=config.batch,
        epochs=config.epochs,
        parallelism=parallelism,
        fsdp_wrap=[Block] if parallelism == "fsdp" else None,
        callbacks=[MemoryProbe()],
        max_restarts=0,
        store=store,
        use_gpu=False,
        verbose=False,
    )
    out: dict = {"parallelism": parallelism, "ranks": ranks}
    start = time.perf_counter()
    try:
        model = est.fit(df)
    except Exception as e:  # the limit's DDP run is expected to fail
        out.update(wall=time.perf_counter() - start, error=f"{type(e).__name__}: {e}")
        shutil.rmtree(folder, ignore_errors=True)
        return out
    out["wall"] = time.perf_counter() - start
    try:
        history = model.getHistory()
        summary = model.getTrainingSummary()
        ranks_json = bc.rank_timings(store, model.getRunId())["ranks"]
    finally:
        del model
        gc.collect()
        shutil.rmtree(folder, ignore_errors=True)
    out.update(measures(history, summary, ranks_json))
    return out


def measures(history: list[dict], summary: dict, ranks_json: list[dict]) -> dict:
    """Per rank (rank order) memory from epoch 1's probe and the summary; per epoch the
    slowest rank's seconds per step."""
    probe = sorted(history[0]["bench_memory"], key=lambda r: r["rank"])
    memory = sorted(summary["rank_memory"], key=lambda r: r["rank"])
    batches = {r["rank"]: r["batches_per_epoch"] for r in ranks_json}
    per_rank = []
    for p, m in zip(probe, memory, strict=True):
        base = p["baseline_rss"]
        per_rank.append(
            {
                "rank": p["rank"],
                "parameter_elements": m["parameter_elements"],
                "baseline_mib": base / MIB if base is not None else None,
                "train_peak_mib": p["peak_rss"] / MIB,
                "train_mib": (p["peak_rss"] - base) / MIB if base is not None else None,
                "fit_peak_mib": m["peak_memory_mib"],
                "virtual_overhead_mib": (p["vm_peak"] - p["vm_hwm"]) / MIB,
                "rlimit_as": p["rlimit_as"],
            }
        )
    step_s = []
    for e, record in enumerate(history):
        train = record["seconds"]["train"]
        step_s.append(max(s / max(1, batches[r][e]) for r, s in enumerate(train)))
    return {
        "per_rank": per_rank,
        "step_s": step_s,
        "steps": [batches[0][e] for e in range(len(history))],
        "loss": [record["train"]["loss"] for record in history],
    }


# -- the targets -----------------------------------------------------------------------------------
def train_mib(run: dict, rank: str = "max") -> float | None:
    """A run's training memory (MiB): the largest rank's, or the smallest's."""
    values = [r["train_mib"] for r in run.get("per_rank", []) if r["train_mib"] is not None]
    if not values:
        return None
    return max(values) if rank == "max" else min(values)


def memory_target(fsdp_mib: float, ddp_mib: float, ranks: int, activations_mib: float) -> dict:
    """Target (1): FSDP's training memory <= 1.3 x DDP's / N + activations."""
    bound = MEMORY_TARGET * ddp_mib / ranks + activations_mib
    return {"bound": bound, "met": fsdp_mib <= bound, "ratio": fsdp_mib / (ddp_mib / ranks)}


def time_target(fsdp_s: float, ddp_s: float) -> dict:
    """Target (2): FSDP's step time at 2 ranks <= 1.5 x DDP's."""
    return {"ratio": fsdp_s / ddp_s, "met": fsdp_s / ddp_s <= TIME_TARGET}


def limit_between(fsdp_need_mib: float, ddp_need_mib: float) -> float | None:
    """A per-rank limit (MiB, a multiple of 256) halfway between what FSDP needs and what
    DDP needs; None when they are less than LIMIT_GAP_GIB apart."""
    if ddp_need_mib - fsdp_need_mib < LIMIT_GAP_GIB * 1024:
        return None
    return 256 * round((fsdp_need_mib + ddp_need_mib) / 2 / 256)


def limit_needs(fsdp: dict, ddp: dict) -> tuple[float, float]:
    """(FSDP's need, DDP's need) in MiB of address space, from the measured runs: FSDP's
    largest fit peak RSS, DDP's smallest training peak RSS, each plus the largest virtual
    overhead seen."""
    runs = [r for r in (fsdp, ddp) if "per_rank" in r]
    overhead = max(p["virtual_overhead_mib"] for r in runs for p in r["per_rank"])
    fsdp_need = max(p["fit_peak_mib"] for p in fsdp["per_rank"]) + overhead
    ddp_need = min(p["train_peak_mib"] for p in ddp["per_rank"]) + overhead
    return fsdp_need, ddp_need


# -- the report ----------------------------------------------------------------------------------
def fmt(value, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def run_rows(runs: list[dict]) -> list[str]:
    lines = [
        "| parallelism | ranks | rank | parameter elements | baseline RSS MiB | training peak "
        "RSS MiB | training memory MiB | fit peak RSS MiB | virtual overhead MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        if "per_rank" not in run:
            continue
        for r in run["per_rank"]:
            lines.append(
                f"| {run['parallelism']} | {run['ranks']} | {r['rank']} | "
                f"{r['parameter_elements']:,} | {fmt(r['baseline_mib'])} | "
                f"{fmt(r['train_peak_mib'])} | {fmt(r['train_mib'])} | "
                f"{fmt(r['fit_peak_mib'])} | {fmt(r['virtual_overhead_mib'])} |"
            )
    return lines


def summary_rows(runs: list[dict]) -> list[str]:
    lines = [
        "| parallelism | ranks | training memory MiB (max rank) | fit peak RSS MiB (max rank) "
        "| step s (last epoch) | step s (epoch 1) | fit wall s | train loss (epochs) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for run in runs:
        name = f"| {run['parallelism']} | {run['ranks']} |"
        if "skipped" in run:
            lines.append(f"{name} not run: {run['skipped']} | | | | | |")
        elif "error" in run:
            lines.append(
                f"{name} FAILED after {run['wall']:.1f} s: {short(run['error'])} | | | | | |"
            )
        else:
            peak = max(r["fit_peak_mib"] for r in run["per_rank"])
            steps = run["step_s"]
            loss = ", ".join(f"{v:.3f}" for v in run["loss"])
            lines.append(
                f"{name} {fmt(train_mib(run))} | {fmt(peak)} | {steps[-1]:.2f} | "
                f"{steps[0]:.2f} | {run['wall']:.1f} | {loss} |"
            )
    return lines


def short(error: str, limit: int = 240) -> str:
    first = " ".join(error.split())
    return (first[:limit] + " ...") if len(first) > limit else first


def find(runs: list[dict], parallelism: str, ranks: int) -> dict | None:
    return next((r for r in runs if r["parallelism"] == parallelism and r["ranks"] == ranks), None)


def target_lines(runs: list[dict], ranks: list[int], activations_mib: float) -> list[str]:
    lines = []
    for n in ranks:
        fsdp, ddp = find(runs, "fsdp", n), find(runs, "ddp", n)
        source = f"DDP at {n} ranks"
        if ddp is None or train_mib(ddp) is None:  # DDP's per-rank memory is the same at any N
            measured = [r for r in runs if r["parallelism"] == "ddp" and train_mib(r)]
            ddp = measured[0] if measured else None
            source = f"DDP at {ddp['ranks']} ranks (DDP at {n} ranks not run)" if ddp else ""
        if fsdp is None or train_mib(fsdp) is None or ddp is None:
            lines.append(f"- Memory at {n} ranks: not measured")
            continue
        t = memory_target(train_mib(fsdp), train_mib(ddp), n, activations_mib)
        lines.append(
            f"- Memory at {n} ranks: FSDP's training memory {train_mib(fsdp):,.0f} MiB (largest "
            f"rank) against {source}: {train_mib(ddp):,.0f} MiB / {n} = "
            f"{train_mib(ddp) / n:,.0f} MiB, ratio **{t['ratio']:.2f}**; bound 1.3 x that + "
            f"activations ({activations_mib:,.0f} MiB) = {t['bound']:,.0f} MiB: "
            f"{'met' if t['met'] else 'MISSED'}"
        )
    fsdp, ddp = find(runs, "fsdp", 2), find(runs, "ddp", 2)
    if fsdp and ddp and "step_s" in fsdp and "step_s" in ddp:
        t = time_target(fsdp["step_s"][-1], ddp["step_s"][-1])
        lines.append(
            f"- Step time at 2 ranks (last epoch): FSDP {fsdp['step_s'][-1]:.2f} s / DDP "
            f"{ddp['step_s'][-1]:.2f} s = **{t['ratio']:.2f}** (target <= {TIME_TARGET}: "
            f"{'met' if t['met'] else 'MISSED'})"
        )
    else:
        lines.append("- Step time at 2 ranks: not measured")
    return lines


def limit_lines(limit: dict) -> list[str]:
    if "skipped" in limit:
        return [f"- Per-rank memory limit: not run: {limit['skipped']}"]
    ddp, fsdp = limit["ddp"], limit["fsdp"]
    ddp_failed, fsdp_ok = "error" in ddp, "per_rank" in fsdp
    lines = [
        f"- Per-rank memory limit `spark.executor.pyspark.memory={limit['limit_mib']}m` "
        f"(`RLIMIT_AS` {limit['limit_mib'] / 1024:.2f} GiB of address space per Python worker; "
        f"{limit['how']}):",
        f"  - DDP, {ddp['ranks']} ranks: "
        + (
            f"failed after {ddp['wall']:.1f} s, as it must: {short(ddp['error'], 400)}"
            if ddp_failed
            else "TRAINED (the limit did not stop it)"
        ),
        f"  - FSDP, {fsdp['ranks']} ranks: "
        + (
            f"trained in {fsdp['wall']:.1f} s; RLIMIT_AS seen by the ranks: "
            f"{sorted({r['rlimit_as'] for r in fsdp['per_rank']})}; fit peak RSS per rank "
            + ", ".join(f"{r['fit_peak_mib']:,.0f}" for r in fsdp["per_rank"])
            + " MiB"
            if fsdp_ok
            else f"FAILED: {short(fsdp.get('error', fsdp.get('skipped', '?')), 400)}"
        ),
        f"  - Target (a model DDP cannot fit under a per-rank limit, trained by FSDP under it): "
        f"{'met' if ddp_failed and fsdp_ok else 'MISSED'}",
    ]
    return lines


# -- main ------------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for field, value in asdict(FULL).items():
        parser.add_argument(f"--{field}", type=int, default=value)
    parser.add_argument("--ranks", default="2,4", help="rank counts, comma-separated")
    parser.add_argument("--no-limit", action="store_true", help="skip the memory-limit runs")
    parser.add_argument("--limit-gib", type=float, default=None, help="per-rank limit to use")
    parser.add_argument("--margin-gib", type=float, default=1.5, help="memory kept free")
    parser.add_argument("--store-dir", default=tempfile.gettempdir(), help="where stores go")
    parser.add_argument("--quiet-timeout", type=float, default=60.0)
    bc.add_record_args(parser)
    args = parser.parse_args()
    config = Config(**{f: getattr(args, f) for f in asdict(FULL)})
    ranks = sorted(int(n) for n in args.ranks.split(","))
    margin = args.margin_gib * GIB

    params = parameters(config)
    activations_mib = activation_bytes(config) / MIB
    env = bc.machine()
    print(
        f"model: {params:,} parameters ({config}); activations per rank {activations_mib:.1f} "
        f"MiB; {env['cpu']}, {env['cores']} cores, {env['ram_gib']:.1f} GiB RAM, "
        f"{available_bytes() / GIB:.1f} GiB available",
        flush=True,
    )
    baseline = 0.7 * GIB  # for the estimates until a fit has measured it
    runs: list[dict] = []
    contended = 0
    for n in ranks:
        spark = bc.spark_session(f"local[{n}]", {"spark.python.worker.reuse": "false"})
        try:
            for parallelism in ("ddp", "fsdp"):
                why = fits(params, n, parallelism, baseline, margin)
                if why:
                    runs.append({"parallelism": parallelism, "ranks": n, "skipped": why})
                    print(f"{parallelism} x {n}: not run: {why}", flush=True)
                    continue
                contended += not bc.wait_quiet(args.quiet_timeout)
                run = run_fit(spark, config, parallelism, n, args.store_dir)
                runs.append(run)
                if "error" in run:
                    print(f"{parallelism} x {n}: FAILED: {run['error']}", flush=True)
                    continue
                bases = [r["baseline_mib"] for r in run["per_rank"] if r["baseline_mib"]]
                baseline = max(baseline, max(bases, default=0) * MIB)
                print(
                    f"{parallelism} x {n}: {run['wall']:.1f} s, step {run['step_s']} s, "
                    f"per rank {run['per_rank']}",
                    flush=True,
                )
        finally:
            spark.stop()

    limit: dict = {}
    fsdp_big, ddp_small = find(runs, "fsdp", ranks[-1]), find(runs, "ddp", ranks[0])
    if args.no_limit:
        limit["skipped"] = "--no-limit"
    elif not (fsdp_big and ddp_small and "per_rank" in fsdp_big and "per_rank" in ddp_small):
        limit["skipped"] = "FSDP at the largest or DDP at the smallest rank count was not measured"
    else:
        fsdp_need, ddp_need = limit_needs(fsdp_big, ddp_small)
        if args.limit_gib:
            limit_mib = round(args.limit_gib * 1024)
            how = "set by --limit-gib"
        else:
            limit_mib = limit_between(fsdp_need, ddp_need)
            how = (
                f"halfway between FSDP's need at {ranks[-1]} ranks, {fsdp_need:,.0f} MiB (its "
                f"largest fit peak RSS + the largest virtual overhead), and DDP's need, "
                f"{ddp_need:,.0f} MiB (its smallest training peak RSS + the same overhead)"
            )
        worst = ranks[0] * (limit_mib or 0) * MIB + margin
        if limit_mib is None:
            limit["skipped"] = (
                f"FSDP's need ({fsdp_need:,.0f} MiB) and DDP's ({ddp_need:,.0f} MiB) are less "
                f"than {LIMIT_GAP_GIB} GiB apart: no room for a limit between them"
            )
        elif worst > available_bytes():
            limit["skipped"] = f"DDP's {ranks[0]} ranks could take {worst / GIB:.1f} GiB"
        else:
            limit.update(limit_mib=limit_mib, how=how)
            conf = {
                "spark.python.worker.reuse": "false",
                "spark.executor.pyspark.memory": f"{limit_mib}m",
            }
            spark = bc.spark_session(f"local[{ranks[-1]}]", conf)
            short_fit = replace(config, epochs=1, steps=min(2, config.steps))
            try:
                contended += not bc.wait_quiet(args.quiet_timeout)
                limit["ddp"] = run_fit(spark, short_fit, "ddp", ranks[0], args.store_dir)
                print(f"limit {limit_mib} MiB, ddp x {ranks[0]}: {limit['ddp']}", flush=True)
                why = fits(params, ranks[-1], "fsdp", baseline, margin)
                if why:
                    limit["fsdp"] = {"parallelism": "fsdp", "ranks": ranks[-1], "skipped": why}
                else:
                    contended += not bc.wait_quiet(args.quiet_timeout)
                    limit["fsdp"] = run_fit(spark, short_fit, "fsdp", ranks[-1], args.store_dir)
                print(f"limit {limit_mib} MiB, fsdp x {ranks[-1]}: {limit['fsdp']}", flush=True)
            finally:
                spark.stop()

    full = config == FULL and ranks == [2, 4] and not args.no_limit
    lines = [
        f"## {env['date']}, stack `{env['venv']}`",
        "",
        *bc.machine_lines(env),
        f"- Model: {params:,} parameters ({config.layers} blocks, width {config.width}, "
        f"{config.heads} heads), float32, Adam; batch {config.batch} x {config.tokens} tokens "
        f"per rank, {config.epochs} epochs of {config.steps} steps; activations per rank "
        f"(tensors saved for backward) {activations_mib:,.1f} MiB; "
        f"{'the full size' if full else 'SMALLER THAN THE FULL SIZE'}",
        f"- Ranks: {ranks} (`local[N]`, one torch thread each; with more ranks than the "
        f"{env['cores']} cores they time-share: those step times are not scaling numbers); "
        f"{contended} fit(s) started while other processes kept the CPUs busy",
        "",
        *summary_rows(runs),
        "",
        "Per rank (training peak: `ru_maxrss` after epoch 1's steps, before its checkpoint; "
        "training memory: that less the baseline, the RSS before the model was built; fit "
        "peak: the library's `rank_memory`, the whole fit with checkpoints and the result):",
        "",
        *run_rows(runs),
        "",
        *target_lines(runs, ranks, activations_mib),
        *limit_lines(limit),
    ]
    section = "\n".join(lines) + "\n"
    print("\n" + section)
    bc.record(args, NAME, HEADER, section, env["venv"], full)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    sys.exit(main())
