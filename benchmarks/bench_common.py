"""Shared by the benchmark scripts of benchmarks/ (not a benchmark itself).

- The job they all time, unless a script says otherwise: ``rows`` x 32 float32 features
  (one ``array<float>`` column ``features``) and a float32 label ``label`` = x . w + noise,
  generated from a fixed numpy seed; an MLP 32-256-256-1, MSE, SGD(lr=0.01), global batch
  512. ``dataset`` writes the rows once as Parquet (read back by Spark, so a DataFrame's
  source is a file, as in production); ``job_arrays`` regenerates the same rows in memory
  for the hand-written baselines.
- ``spark_session``: a local Spark whose executors run this interpreter.
- ``fit_phases``: times ``TorchEstimator``'s own steps (validate, materialize, the barrier
  job, the fit's end) by wrapping its private methods for the duration of a ``with`` block:
  measured from the outside, independently of the ``fit_seconds`` the library reports in a
  model's training summary (the same split, taken by the fit itself). ``rank_timings``
  reads the ranks' training time (``runs/<run_id>/ranks.json``) and, from the checkpoint
  files' modification times, the end of each epoch.
- ``timed_fit``: one fit with its wall time, ``fit_phases`` and ``rank_timings``, as the
  scripts that time fits take it.
- ``machine`` and ``record``: the machine, library versions and date, and the results file,
  one section per stack (virtual environment), as ``loader_benchmark.py`` writes them.

Spark's Python workers cannot import this module (``benchmarks/`` is not on their path), so
it registers itself to be pickled by value, as code in ``__main__`` is.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import cloudpickle
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SMALL_RESULTS = Path(tempfile.gettempdir()) / "spark-estimator-bench-results"
DATA = Path(tempfile.gettempdir()) / "spark-estimator-bench-data"

SEED = 20240601
FEATURES = 32
FULL_ROWS = 1_000_000
FULL_EPOCHS = 2
GLOBAL_BATCH = 512
LR = 0.01
HIDDEN = (256, 256)
INPUT_FILES = 8


def by_value(module) -> None:
    """Pickle ``module``'s functions and classes by value, as ``__main__``'s are: Spark's
    Python workers and the decode workers cannot import a benchmark's modules."""
    cloudpickle.register_pickle_by_value(module)
    try:  # pyspark ships its own copy of cloudpickle for UDFs and mapInPandas functions
        from pyspark import cloudpickle as pyspark_cloudpickle

        pyspark_cloudpickle.register_pickle_by_value(module)
    except (ImportError, AttributeError):
        pass


by_value(sys.modules[__name__])


# -- the job ---------------------------------------------------------------------------------
def job_arrays(
    rows: int, seed: int = SEED, features: int = FEATURES
) -> tuple[np.ndarray, np.ndarray]:
    """The job's rows in memory: features [rows, ``features``] and label [rows], float32.

    Row i is the same for every ``rows`` >= i (chunks of 65,536 rows, each from its own
    generator), so a small run trains on a prefix of the full job's rows."""
    w = np.random.default_rng(seed).standard_normal(features).astype(np.float32)
    w /= np.sqrt(features)
    chunk = 65_536
    xs, ys = [], []
    for i, start in enumerate(range(0, rows, chunk)):
        n = min(chunk, rows - start)
        rng = np.random.default_rng([seed, i])
        x = rng.standard_normal((n, features), dtype=np.float32)
        noise = rng.standard_normal(n, dtype=np.float32)
        xs.append(x)
        ys.append((x @ w + np.float32(0.1) * noise).astype(np.float32))
    return np.concatenate(xs), np.concatenate(ys)


def dataset(
    rows: int, folder: Path = DATA, files: int = INPUT_FILES, features: int = FEATURES
) -> str:
    """The job's rows as ``files`` snappy Parquet files (``features`` list<float>, ``label``
    float), written under ``folder`` unless already there; returns the folder of the files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    wide = "" if features == FEATURES else f"-features-{features}"
    target = Path(folder) / f"rows-{rows}-seed-{SEED}{wide}"
    done = target / "_bench_done.json"  # Spark skips files whose name starts with "_"
    if done.exists():
        return str(target)
    print(f"writing the job's {rows:,} rows to {target} ...", flush=True)
    target.mkdir(parents=True, exist_ok=True)
    x, y = job_arrays(rows, features=features)
    bounds = np.linspace(0, rows, files + 1).astype(int)
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        offsets = pa.array(np.arange(0, (b - a + 1) * features, features, dtype=np.int32))
        column = pa.ListArray.from_arrays(offsets, pa.array(x[a:b].reshape(-1)))
        table = pa.table({"features": column, "label": pa.array(y[a:b])})
        pq.write_table(table, target / f"part-{i:05d}.parquet", compression="snappy")
    done.write_text(json.dumps({"rows": rows, "seed": SEED, "files": files, "width": features}))
    return str(target)


def frame(spark, path: str, layout: str = "array"):
    """The job's DataFrame, read from ``path``: ``features`` as array<float> ("array") or as
    a Spark ML vector ("vector", made with array_to_vector), and ``label`` (float)."""
    df = spark.read.parquet(path)
    if layout == "vector":
        from pyspark.ml.functions import array_to_vector

        df = df.select(array_to_vector("features").alias("features"), "label")
    elif layout != "array":
        raise ValueError(f"layout: 'array' or 'vector', got {layout!r}")
    return df


def mlp(hidden: tuple[int, ...] = HIDDEN, inputs: int = FEATURES, seed: int = 0):
    """MLP inputs-hidden...-1 with ReLUs, initialized from ``seed``."""
    import torch

    torch.manual_seed(seed)
    layers, width = [], inputs
    for h in hidden:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    layers.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*layers)


def estimator(store, net=None, **params):
    """TorchEstimator for the job (CPU, 2 processes x batch 256, quiet); ``params`` override."""
    import torch

    from spark_estimator import TorchEstimator

    net = net if net is not None else mlp()
    base = dict(
        model=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=LR),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["label"],
        num_proc=2,
        batch_size=GLOBAL_BATCH // 2,
        epochs=FULL_EPOCHS,
        store=store,
        use_gpu=False,
        verbose=False,
    )
    base.update(params)
    return TorchEstimator(**base)


def loader_only_spec(data, store, batch_size: int, **loader):
    """A TrainSpec for opening ``data``'s loaders alone (``open_loader``, no model): one
    epoch, seed 0, CPU; ``loader``: LoaderSpec's fields."""
    from spark_estimator.shared.spec import LoaderSpec, TrainSpec

    return TrainSpec(
        bundle=b"",
        data=data,
        store=store,
        run_id="bench",
        batch_size=batch_size,
        epochs=1,
        seed=0,
        use_gpu=False,
        input_shapes=None,
        loader=LoaderSpec(**loader),
    )


def hand_loop(net, x, y, batch_size: int, epochs: int, device="cpu", seed: int = 0) -> float:
    """Train ``net`` on tensors ``x``, ``y`` ([N, 1]) already on ``device``: per epoch one
    shuffled pass (``torch.randperm``) in batches of ``batch_size``, SGD(lr=0.01), MSE.
    Returns the seconds the loop took (synchronized on CUDA)."""
    import torch

    net = net.to(device).train()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    loss_fn = torch.nn.MSELoss()
    generator = torch.Generator(device=device).manual_seed(seed)
    n = x.shape[0]
    if device != "cpu":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(epochs):
        order = torch.randperm(n, device=device, generator=generator)
        for i in range(0, n, batch_size):
            index = order[i : i + batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(net(x[index]), y[index])
            loss.backward()
            optimizer.step()
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - start


# -- Spark -----------------------------------------------------------------------------------
def spark_session(master: str, conf: dict | None = None, driver_memory: str = "4g"):
    """A Spark session on ``master`` whose Python workers run this interpreter."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(master)
        .appName("spark-estimator benchmark")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "8")
        .config("spark.driver.memory", driver_memory)
    )
    for key, value in (conf or {}).items():
        builder = builder.config(key, str(value))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


# -- timing ----------------------------------------------------------------------------------
_PHASED = ("_validate", "_materialize", "_train", "_launch")


@contextmanager
def fit_phases() -> Iterator[dict]:
    """Within the block, every ``TorchEstimator`` call of ``_validate``, ``_materialize``,
    ``_train`` (everything after materialization) and ``_launch`` (the barrier job inside
    ``_train``: ``driver.fit``'s ``run_training_job``) adds its seconds to the yielded dict
    under those names, and ``_materialize`` sets ``reused`` (the dataset was found in the
    store). Private names, wherever in the class hierarchy they are defined: a name the
    library no longer has is skipped and its phase stays unmeasured (the dict lacks the
    key)."""
    from spark_estimator import TorchEstimator

    times: dict = {}
    own = {n: TorchEstimator.__dict__[n] for n in _PHASED if n in TorchEstimator.__dict__}
    found = {n: getattr(TorchEstimator, n) for n in _PHASED if hasattr(TorchEstimator, n)}

    def timed(name: str, original: Callable) -> Callable:
        def wrapper(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                result = original(self, *args, **kwargs)
            finally:
                times[name] = times.get(name, 0.0) + time.perf_counter() - start
            if name == "_materialize":
                times["reused"] = bool(getattr(result, "reused", False))
            return result

        return wrapper

    for name, original in found.items():
        setattr(TorchEstimator, name, timed(name, original))
    # the barrier job: a function of the fit's module, called from ``_train``
    fit_module = sys.modules.get("spark_estimator.driver.fit")
    job = getattr(fit_module, "run_training_job", None)
    if job is not None:

        def launch(*args, **kwargs):
            start = time.perf_counter()
            try:
                return job(*args, **kwargs)
            finally:
                times["_launch"] = times.get("_launch", 0.0) + time.perf_counter() - start

        fit_module.run_training_job = launch
    try:
        yield times
    finally:
        if job is not None:
            fit_module.run_training_job = job
        for name in found:
            if name in own:
                setattr(TorchEstimator, name, own[name])
            else:
                delattr(TorchEstimator, name)


def timed_fit(est, df, store) -> dict:
    """One ``est.fit(df)`` timed from the outside: the ``model``, its wall time ``total``,
    the wrapped methods' seconds ``times`` (``fit_phases``), and ``train_s``, ``epoch_s``
    and the ranks' summaries ``ranks`` from the store (``rank_timings``)."""
    with fit_phases() as times:
        start = time.perf_counter()
        model = est.fit(df)
        total = time.perf_counter() - start
    return {"model": model, "total": total, "times": times, **rank_timings(store, model.getRunId())}


def rank_timings(store, run_id: str) -> dict:
    """What a local store tells about a finished run's time: ``train_s``, the longest rank's
    training time (``seconds`` in ranks.json: from the end of the rank's setup, loaders
    opened, to its summary, after rank 0 wrote the result), and ``epoch_s``, each epoch's
    seconds on rank 0 (differences of the checkpoints' modification times, the first counted
    from the start of rank 0's training time, i.e. result.pt's time less its ``seconds``);
    ``None`` where the store does not say; and ``ranks``, ranks.json itself."""
    run = store.run(run_id)
    ranks = store.read_json(run.ranks)
    seconds = [r.get("seconds") for r in ranks]
    known = all(isinstance(s, (int, float)) for s in seconds)
    train_s = max(seconds) if known and seconds else None
    out: dict = {"train_s": train_s, "epoch_s": None, "ranks": ranks}
    rank0 = next((r for r in ranks if r.get("rank") == 0 and "seconds" in r), None)
    result = run.result
    epochs = store.checkpoint_epochs(run_id)
    if rank0 is not None and epochs and os.path.exists(result):
        ends = [os.path.getmtime(run.checkpoint(e)) for e in epochs]
        start = os.path.getmtime(result) - rank0["seconds"]
        out["epoch_s"] = [b - a for a, b in zip([start, *ends[:-1]], ends)]
    return out


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` within the block."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def thread_counts(text: str) -> list[int]:
    """``--hand-threads``: comma-separated torch thread counts ("1,2"), each positive."""
    counts = sorted({int(t) for t in text.split(",") if t.strip()})
    if not counts or counts[0] < 1:
        raise ValueError(f"thread counts must be positive integers, got {text!r}")
    return counts


def time_share(history: list[dict], kind: str = "data") -> float | None:
    """A share the progress bar shows (``data=``, ``comp=``, ``comm=``), over a whole fit:
    the seconds of ``kind`` ("data": the steps waited for their batches, "compute",
    "communication") / the training seconds, each summed over ranks and epochs of the
    history's per-epoch ``seconds`` (one epoch's: ``spark_estimator.shared.history.
    time_shares``); None for a history without timings."""
    records = [r["seconds"] for r in history if r.get("seconds")]
    train = sum(sum(s["train"]) for s in records)
    return sum(sum(s[kind]) for s in records) / train if train else None


def dataset_files(store) -> dict[str, float]:
    """Every file under the store's ``datasets/`` with its modification time."""
    root = Path(store.datasets)
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): p.stat().st_mtime for p in root.rglob("*") if p.is_file()}


def best_median(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{min(values):.2f} (median {statistics.median(values):.2f})"


def wait_quiet(limit_s: float, threshold: float = 0.3) -> bool:
    """Wait up to ``limit_s`` until other processes leave the CPUs idle (less than
    ``threshold`` CPUs busy over half a second); False if they stayed busy."""
    deadline = time.monotonic() + limit_s
    while busy_cpus() > threshold:
        if time.monotonic() > deadline:
            return False
        time.sleep(2)
    return True


def busy_cpus(seconds: float = 0.5) -> float:
    """How many CPUs' worth of work the whole machine did over ``seconds`` (/proc/stat)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return sum(values), values[3] + values[4]  # total, idle + iowait

    (total0, idle0), _, (total1, idle1) = sample(), time.sleep(seconds), sample()
    return (os.cpu_count() or 1) * (1 - (idle1 - idle0) / max(1, total1 - total0))


# -- the machine and the results ---------------------------------------------------------------
def machine(extra_packages: tuple[str, ...] = ()) -> dict:
    """CPU, cores, RAM, GPU, Python and library versions, the stack, the code, the date."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
        with open("/proc/meminfo") as f:
            ram = int(re.search(r"MemTotal:\s+(\d+)", f.read()).group(1)) / 2**20
    except (OSError, AttributeError):
        ram = float("nan")
    versions = {}
    for name in ("torch", "pyspark", "pyarrow", "numpy", "pandas", *extra_packages):
        try:
            versions[name] = __import__(name).__version__
        except Exception as e:  # petastorm fails to import on a new pyarrow
            versions[name] = f"not importable ({type(e).__name__})"
    gpu = "none"
    try:
        import torch

        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            gpu = f"{count} x {torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    except Exception:
        pass
    venv = sys.prefix
    if venv.startswith(str(ROOT)):
        venv = os.path.relpath(venv, ROOT)
    return {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": ram,
        "gpu": gpu,
        "python": platform.python_version(),
        "venv": venv,
        "commit": _commit(),
        "load": os.getloadavg()[0],
        **versions,
    }


def _commit() -> str:
    try:
        git = ["git", "-C", str(ROOT)]
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "spark_estimator"], capture_output=True, text=True
        ).stdout.strip()
        return f"{head}{' + uncommitted changes in spark_estimator/' if dirty else ''}" or "?"
    except OSError:
        return "unknown"


def machine_lines(env: dict, extra: tuple[str, ...] = ()) -> list[str]:
    """The machine as the first bullet points of a results section."""
    libs = ", ".join(
        f"{n} {env[n]}" for n in ("torch", "pyspark", "pyarrow", "numpy", "pandas", *extra)
    )
    return [
        f"- Machine: {env['cpu']}, {env['cores']} cores, {env['ram_gib']:.1f} GiB RAM, "
        f"GPU: {env['gpu']}",
        f"- Python {env['python']} (`{env['venv']}`), {libs}",
        f"- Code: {env['commit']}; 1-minute load average {env['load']:.2f} before the run, "
        f"{os.getloadavg()[0]:.2f} after (other processes may share the cores; re-run if high)",
    ]


def add_run_args(parser, quick: str) -> None:
    """The arguments of ``image_fit.py`` and ``text_fit.py`` beside their sizes: the fit's
    processes and master, the hand loop's DataLoader workers and torch threads, where data
    and stores go, the quiet-machine wait, ``--quick`` (``quick`` says what it runs) and
    the record arguments."""
    parser.add_argument("--num-proc", type=int, default=2, help="training processes of the fit")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument(
        "--loader-workers", type=int, default=os.cpu_count(), help="the hand loop's workers"
    )
    parser.add_argument(
        "--hand-threads",
        default=f"1,{os.cpu_count()}",
        help="torch thread counts of the hand loop's training process, each timed; the "
        "fastest is the baseline",
    )
    parser.add_argument("--data", default=str(DATA), help="folder of the generated data")
    parser.add_argument("--store-dir", default=tempfile.gettempdir(), help="where stores go")
    parser.add_argument("--quiet-timeout", type=float, default=60.0)
    parser.add_argument("--quick", action="store_true", help=f"a validation run: {quick}")
    add_record_args(parser)


def fill_sizes(args, sizes: dict[str, tuple[int, int]]) -> None:
    """Each argument of ``sizes`` (name -> (full, quick)) left unset: its quick value with
    ``--quick``, else its full one."""
    for name, (full, quick) in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)


def add_pass_args(parser) -> None:
    """The arguments of ``decode_pool.py`` and ``transform_images.py`` beside their own:
    ``--images``, ``--repeats`` (the best is kept), ``--quick`` (512 images, 1 repeat), the
    quiet-machine wait and the record arguments; ``pass_sizes`` reads the first three."""
    parser.add_argument("--images", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="512 images, 1 repeat")
    parser.add_argument("--quiet-timeout", type=float, default=60.0)
    add_record_args(parser)


def pass_sizes(args, full_images: int) -> tuple[int, int]:
    """(images, repeats) of ``add_pass_args``' arguments: ``--quick`` runs 512 images (unless
    ``--images`` says otherwise) once."""
    images = args.images or (512 if args.quick else full_images)
    return images, 1 if args.quick else args.repeats


def add_record_args(parser) -> None:
    parser.add_argument(
        "--no-record", action="store_true", help="print the results only, write no file"
    )
    parser.add_argument(
        "--results-dir",
        default=None,
        help=f"where to write the results file (default: {RESULTS.relative_to(ROOT)}/ for a "
        f"run of the full job, {SMALL_RESULTS}/ for a smaller one)",
    )


def record(
    args, name: str, header: str, section: str, venv: str, full_size: bool, extra=()
) -> Path | None:
    """Write ``section`` as this stack's section of ``<results dir>/<name>.md`` (keeping the
    other stacks' sections) under ``header``; ``extra`` files (name -> bytes) go next to it.
    A run smaller than the full job goes to a temporary folder unless ``--results-dir``
    says otherwise, so small runs never replace recorded results."""
    if args.no_record:
        return None
    folder = Path(args.results_dir) if args.results_dir else (RESULTS if full_size else None)
    if folder is None:
        folder = SMALL_RESULTS
        print(f"(a smaller job than the full one: results go to {folder}, not {RESULTS})")
    path = folder / f"{name}.md"
    replace_section(path, header, venv, section)
    for filename, data in dict(extra).items():
        (folder / filename).write_bytes(data)
    print(f"written to {path}")
    return path


def replace_section(path: Path, header: str, key: str, section: str) -> None:
    """Write ``section`` as the ``key`` section of results file ``path`` under ``header``,
    keeping the file's other sections."""
    sections: dict[str, str] = {}
    if path.exists():
        found = re.findall(
            r"<!-- section: (.+?) -->\n(.*?)<!-- end section -->\n", path.read_text(), re.S
        )
        sections = dict(found)
    sections[key] = section
    body = "".join(f"<!-- section: {k} -->\n{v}<!-- end section -->\n" for k, v in sections.items())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + "\n" + body)
