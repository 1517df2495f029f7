"""Plain data handed from the driver to the executors (pickled into the barrier job).

No Spark imports here: the executor side reads these, the driver side builds them.
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass, field

from ..store import Store

DATASET_FORMAT_VERSION = 3  # 3: files under a write folder, row lengths, data checks
SPLITS = ("train", "validation")
COLLECTIVE_TIMEOUT_S = 600.0  # the default of collective_timeout
FLOAT_DTYPES = ("float32", "float64")
READERS = ("arrow", "petastorm")
LR_SCALINGS = ("none", "linear")
PRECISIONS = ("none", "fp16", "bf16")  # for mixed_precision and gradient_compression
GRADIENT_REDUCTIONS = ("average", "adasum")
SCHEDULER_INTERVALS = ("epoch", "step")
PARALLELISMS = ("ddp", "fsdp")  # every rank holds the model (DDP), or a shard of it (FSDP2)
# torch dtypes by name: this module is imported by executor code that needs no torch
PRECISION_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


def torch_dtype(name: str):
    """The torch dtype named ``name`` (``float32``, ``bfloat16``...)."""
    import torch

    return getattr(torch, name)


def column_param(role: str) -> str:
    """The estimator param naming a column of ``role`` (feature, label or sample_weight)."""
    return "sample_weight_col" if role == "sample_weight" else f"{role}_cols"


VARIABLE_KINDS = ("binary", "string", "image", "sequence")
ROW_NAMES = "path"  # a string column naming each row (binaryFile's): named in decoding errors

# Spark's image source: a struct of these fields (BGR bytes in ``data``, OpenCV's ``mode``)
IMAGE_FIELDS = ("origin", "height", "width", "nChannels", "mode", "data")
BAD_ROWS = ("fail", "skip")  # what a row whose decoding fails does (bad_rows)
DECODE_DEVICES = ("cpu", "cuda")  # where encoded images are decoded (decode_device)
DECODE_POOLS = ("auto", "threads", "processes")  # what decodes them on a rank (decode_pool)
# the user's decoding functions (DecodeSpec.functions: pickled together, sharing globals)
DECODE_FUNCTIONS = ("decode_fn", "decode_batch_fn", "decode_init_fn", "collate_fn")


@dataclass(frozen=True)
class ColumnSpec:
    """How one input column is stored in Parquet and turned into a tensor."""

    name: str
    # "scalar" | "array" | "vector" (an ML vector; materialized as an array), or a variable
    # column decoded per row (VARIABLE_KINDS): "binary" (encoded images or other bytes),
    # "string", "image" (Spark's image struct), "sequence" (arrays of varying length)
    kind: str
    dtype: str  # "float32" | "float64" | "int64" (integral labels: class indices)

    @property
    def integral(self) -> bool:
        return self.dtype == "int64"

    @property
    def variable(self) -> bool:
        """Whether rows differ in size: read as Python objects, decoded per row, collated."""
        return self.kind in VARIABLE_KINDS

    @property
    def torch_dtype(self):
        return torch_dtype(self.dtype)


def row_names_column(strings: set[str], columns: list[ColumnSpec]) -> str | None:
    """``ROW_NAMES`` where the data has it as a string column (``strings``: its string
    columns) beside variable ``columns`` it is not one of: read with them, so that a row
    that fails to decode is named; else None."""
    used = {c.name for c in columns}
    if ROW_NAMES in strings and ROW_NAMES not in used and any(c.variable for c in columns):
        return ROW_NAMES
    return None


@dataclass(frozen=True)
class InPlace:
    """A dataset read where its files lie (``driver.in_place``): their layout in the table's
    order (path, rows of each row group), their sizes (a file that changed is refused), and
    how rows are split (``RowSplit``'s fields). The dataset's ``files`` then count each row
    group's rows of each split, which the readers keep as they read."""

    layout: tuple[tuple[str, tuple[int, ...]], ...]
    sizes: tuple[tuple[str, int], ...]
    fraction: float | None = None
    seed: int = 0
    column: str | None = None
    # each row group's uncompressed bytes of the columns read, as ``layout`` (empty: unknown)
    group_bytes: tuple[tuple[int, ...], ...] = ()
    # the checks the ranks make as they read, where the files' statistics settled the rest
    # before the job: per checked column (role, name, NaN and infinities rejected, the row
    # length every array holds or None); empty: all made before the job
    verify: tuple[tuple[str, str, bool, int | None], ...] = ()

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, value: dict) -> InPlace:
        layout = tuple((p, tuple(g)) for p, g in value["layout"])
        sizes = tuple((p, int(n)) for p, n in value["sizes"])
        group_bytes = tuple(tuple(g) for g in value.get("group_bytes", ()))
        verify = tuple(tuple(v) for v in value.get("verify", ()))
        return cls(
            layout, sizes, value["fraction"], value["seed"], value["column"], group_bytes, verify
        )

    def row_group_bytes(self) -> dict[tuple[str, int], int]:
        """Each (file, row group)'s uncompressed bytes of the columns read."""
        return {
            (path, g): size
            for (path, _), sizes in zip(self.layout, self.group_bytes)
            for g, size in enumerate(sizes)
        }


@dataclass
class DatasetInfo:
    """Where a Parquet dataset lives in the store and how its rows are laid out."""

    path: str  # the dataset folder in the store; file paths below are relative to it
    features: list[ColumnSpec]
    labels: list[ColumnSpec]
    # split -> [(file path relative to ``path``, [rows of each row group])]
    files: dict[str, list[tuple[str, list[int]]]]
    reused: bool = False  # found complete in the store rather than written by this fit
    source: dict = field(default_factory=dict)  # what the cache key was computed from
    sample_weight: ColumnSpec | None = None  # per-row loss weights (sample_weight_col)
    # array/vector column -> its values per row, the same in every row (checked when written)
    row_lengths: dict[str, int] = field(default_factory=dict)
    write_id: str | None = None  # the write folder under ``path`` holding the files
    # scalar class-index label column -> [min, max] of its values (counted when written)
    label_ranges: dict[str, list[int]] = field(default_factory=dict)
    # a string column naming each row (binaryFile's ``path``), written beside the data when
    # the DataFrame has one and there are variable columns: named in decoding errors
    row_names: str | None = None
    in_place: InPlace | None = None  # a table's own files, not a materialized copy

    @property
    def variable(self) -> list[ColumnSpec]:
        """The columns decoded per row (``ColumnSpec.variable``)."""
        return [c for c in self.columns if c.variable]

    @property
    def columns(self) -> list[ColumnSpec]:
        return self.features + self.labels + ([self.sample_weight] if self.sample_weight else [])

    def rows(self, split: str) -> int:
        return sum(sum(groups) for _, groups in self.files.get(split, []))

    def row_length(self, column: ColumnSpec) -> int | None:
        """Values per row of ``column``: 1 for scalars; None where it was not recorded."""
        return 1 if column.kind == "scalar" else self.row_lengths.get(column.name)

    def to_json(self) -> dict:
        return {
            "format_version": DATASET_FORMAT_VERSION,
            "features": [asdict(c) for c in self.features],
            "labels": [asdict(c) for c in self.labels],
            "sample_weight": asdict(self.sample_weight) if self.sample_weight else None,
            "files": self.files,
            "rows": {s: self.rows(s) for s in SPLITS},
            "row_lengths": self.row_lengths,
            "write_id": self.write_id,
            "label_ranges": self.label_ranges,
            "row_names": self.row_names,
            "in_place": self.in_place.to_json() if self.in_place else None,
            "source": self.source,
        }

    @classmethod
    def from_json(cls, path: str, meta: dict, reused: bool) -> DatasetInfo:
        return cls(
            path=path,
            features=[ColumnSpec(**c) for c in meta["features"]],
            labels=[ColumnSpec(**c) for c in meta["labels"]],
            files={s: [(f, list(g)) for f, g in files] for s, files in meta["files"].items()},
            reused=reused,
            source=meta["source"],
            sample_weight=ColumnSpec(**weight) if (weight := meta["sample_weight"]) else None,
            row_lengths=dict(meta["row_lengths"]),
            write_id=meta["write_id"],
            label_ranges=dict(meta.get("label_ranges", {})),
            row_names=meta.get("row_names"),
            in_place=InPlace.from_json(meta["in_place"]) if meta.get("in_place") else None,
        )


@dataclass(frozen=True)
class DecodeSpec:
    """How the rows of variable columns become a batch's tensors (``Decoder``): the user's
    functions (``decode_fn``, ``decode_batch_fn``, ``decode_init_fn``, ``collate_fn``: one
    cloudpickle of a dict of those given, so that they share their globals; None: the
    defaults), padding, the decode workers (threads or processes, how many), what a row
    that fails does, how long a batch may take."""

    functions: bytes | None = None  # serialization.pack_functions(decode_fn=..., ...)
    padding_value: float = 0.0  # pads feature sequences to the batch's longest
    pool: str = "auto"  # "auto" | "threads" | "processes" (DECODE_POOLS)
    workers: int | None = None  # threads or processes per rank; None: from the task's CPUs
    bad_rows: str = "fail"  # "fail" | "skip"
    device: str = "cpu"  # where encoded images are decoded: "cpu" | "cuda"
    bucket_by_length: bool = False  # batches of sequences of similar lengths
    timeout: float | None = None  # seconds a batch's decoding may take (None: no limit)


@dataclass(frozen=True)
class LoaderSpec:
    """How each rank reads its shard (the estimators' loader parameters)."""

    reader: str = "arrow"  # "arrow" | "petastorm"
    shuffle: bool = True
    shuffle_buffer_size: int | None = None  # rows; None: as many as fit in 256 MiB
    num_workers: int = 2  # background reader threads
    inmemory_cache_all: bool = False
    # the most of a rank's free device memory (GPU) or available RAM (CPU) its shard may take
    # to be held there for the whole fit; 0: always stream
    device_cache_fraction: float = 0.5
    train_steps_per_epoch: int | None = None
    validation_steps_per_epoch: int | None = None
    transformation_fn: bytes | None = None  # cloudpickled fn(dict of tensors) -> dict
    decode: DecodeSpec | None = None  # how variable columns are decoded (None: none)


COMMIT_AUTO = -1  # commit_every_steps: a few commits per epoch (worker.loop.commits)


@dataclass(frozen=True)
class LoopSpec:
    """How the training loop steps: TorchEstimator's loop parameters (a LightningEstimator
    sets only ``keep_checkpoints``; its Trainer steps)."""

    lr_scaling: str = "none"  # "none" | "linear" (learning rates x world size)
    backward_passes_per_step: int = 1
    gradient_compression: str = "none"  # "none" | "fp16" | "bf16"
    gradient_reduction: str = "average"  # "average" | "adasum"
    mixed_precision: str = "none"  # "none" | "fp16" | "bf16"
    # torch.compile's keyword arguments for the module the ranks train; None: not compiled
    compile: dict | None = None
    loss_weights: tuple[float, ...] | None = None  # one per label column
    lr_scheduler_interval: str = "epoch"  # "epoch" | "step"
    terminate_on_nan: bool = True
    # steps between commits inside an epoch; 0: none; COMMIT_AUTO: a few per epoch
    commit_every_steps: int = 0
    # training batches between two points of rank 0's step scalars (TensorBoard); 0: none
    log_every_steps: int = 0
    parallelism: str = "ddp"  # "ddp" | "fsdp" (worker.comm.fsdp)
    # FSDP: the class names of the submodules sharded as units of their own (the root always)
    fsdp_wrap: tuple[str, ...] = ()

    @property
    def sharded(self) -> bool:
        return self.parallelism == "fsdp"


def compile_backend(options: dict | None) -> str | None:
    """The name of the torch.compile backend of ``compile`` options (None: not compiled):
    a registered backend's name, or a callable backend's class or function name."""
    if options is None:
        return None
    backend = options.get("backend") or "inductor"
    if isinstance(backend, str):
        return backend
    return getattr(backend, "__name__", type(backend).__name__)


def metric_keys(metric_names: list[str], label_cols: list[str]) -> list[str]:
    """History keys of the metrics: the metric's name, suffixed by the label column when
    there are several label columns (``accuracy_y1``)."""
    if len(label_cols) == 1:
        return list(metric_names)
    return [f"{name}_{label}" for name in metric_names for label in label_cols]


def launch_secret() -> str:
    """A fresh random secret for the process group of one barrier job (a launch, or a
    restart of it), made on the driver with the job's spec; it reaches the tasks only inside
    their closure, and seals what they exchange through rank 0's TCPStore
    (``meeting.Meeting``, ``sealed_store``)."""
    return secrets.token_hex(16)


@dataclass
class TrainSpec:
    """Everything a training task needs besides its BarrierTaskContext."""

    # cloudpickle of a dict of the user's objects: model, optimizer, loss, loss_constructors,
    # metrics, lr_scheduler, callbacks, train_minibatch_fn (see build_objects)
    bundle: bytes
    data: DatasetInfo
    store: Store
    run_id: str
    batch_size: int
    epochs: int
    seed: int
    use_gpu: bool | str  # True: required; "auto": where Spark assigned one; False: CPU
    input_shapes: list[list[int]] | None
    loader: LoaderSpec = field(default_factory=LoaderSpec)
    loop: LoopSpec | None = None  # our loop's (worker.loop.train); None for Lightning's Trainer
    keep_checkpoints: int | None = None  # the last k epochs' checkpoints; None keeps all
    collective_timeout: float = COLLECTIVE_TIMEOUT_S  # seconds any rank waits for the others
    launch_id: str = ""  # this fit call's id: names its failure record (record_failure)
    trainer: str = "torch"  # the loop: "torch" (worker.loop.train) or "lightning"
    # the ranks' lines also go to the tasks' own stdout and stderr; not where those are
    # the driver's terminal (local masters), which shows them from the store already
    echo: bool = True
    # the epoch a finished run is trained further from (its last checkpoint), 0 otherwise:
    # a run stopped early there goes on (driver/run_manifest.finished_at)
    further_from: int = 0
    # seals the job's TCPStore; the driver makes a fresh one for each barrier job
    secret: str = field(default_factory=launch_secret, repr=False)
