"""Plain data the executors hand back to the driver about a fit, the same for both trainers.

Every rank returns a ``RankSummary``; the driver checks the ranks agree and writes them to
``runs/<run_id>/ranks.json`` (``dataclasses.asdict``). Rank 0's result in the store carries
the training summary (``training_summary``: what both trainers report, plus each one's own
keys), which becomes the model's ``getTrainingSummary()``. No torch or Spark imports here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RankSummary:
    """What one rank of a fit did: one entry of ``ranks.json``."""

    rank: int
    local_rank: int
    pid: int
    host: str
    device: str  # "cpu", "cuda:0"...
    device_note: str | None  # why the rank fell back to the CPU although use_gpu asked for a GPU
    # "shared memory", or the process group's backend (+ " compressed"); "adasum (<backend>)"
    gradient_path: str
    communicated_dtypes: list[str] | None  # gradient_compression's dtypes sent; else None
    gradient_allreduces: int | None  # bucket allreduces of our gradient hook; None without one
    train_rows: int  # this rank's shard of the training rows
    validation_rows: int  # this rank's shard of the validation rows
    validation_batches_per_epoch: int  # 0 without validation rows
    # "held on <device>: ..." (read once into the device's memory) or "streaming: <why>"
    data_placement: str
    # one entry per epoch this attempt ran, counted as the epoch ran
    batches_per_epoch: list[int]  # batches drawn from the loader
    optimizer_steps_per_epoch: list[int]  # Lightning: trainer.global_step's growth (see there)
    weights_digest: str  # of the final weights: the same on every rank
    seconds: float  # from the end of the rank's setup (loaders open) to its summary
    compiled: str | None = None  # the torch.compile backend of the module trained; None: eager
    paused: bool = False  # stopped at an epoch's end so the job starts again larger (elastic)
    parameter_elements: int = 0  # the model's parameter elements this rank held (FSDP: shards)
    peak_memory_bytes: int = 0  # the process's peak memory at its end, as peak_memory_kind says
    peak_memory_kind: str = ""  # "cuda max allocated" or "cpu peak rss"
    # the GPU addresses Spark assigned the task: also where it fell back to the CPU
    gpu_addresses: list[str] = field(default_factory=list)
    rows_skipped: int = 0  # rows whose decoding failed, left out (bad_rows="skip")
    # values of the padded sequences this rank collated: [their own, with the padding]
    padding: list[int] = field(default_factory=lambda: [0, 0])
    # how it decoded variable columns (Decoder.summary: pool, workers, the workers' peak
    # memory); None without them
    decoding: dict | None = None


def training_summary(
    world_size: int,
    epochs: int,
    history: list[dict],
    resumed_from_epoch: int,
    early_stopping_epoch: int | None,
    selection: dict | None,
    checkpoints: list[int],
) -> dict:
    """The keys of the training summary both trainers report: ``history`` is the run's
    records (one per epoch run), ``resumed_from_epoch`` the checkpoint this attempt continued
    from (0: none), ``early_stopping_epoch`` the epoch an early-stopping callback stopped
    the run, ``selection`` how the model's weights were chosen (None: the last epoch's)."""
    return {
        "world_size": world_size,
        "epochs_run": len(history),
        "resumed_from_epoch": resumed_from_epoch or None,
        "stopped_early": len(history) < epochs,
        "early_stopping_epoch": early_stopping_epoch,
        "selected_epoch": selection["epoch"] if selection else len(history),
        "selection": selection,
        "checkpoints": checkpoints,
    }


def seconds_per_rank(history: list[dict]) -> dict[str, list[float]] | None:
    """Every rank's seconds of training, per kind (train, data, compute, communication),
    summed over the epochs whose records carry them (TorchEstimator's loop); None without."""
    timed = [record["seconds"] for record in history if record.get("seconds")]
    if not timed:
        return None
    return {
        kind: [round(sum(values), 3) for values in zip(*(t[kind] for t in timed))]
        for kind in timed[0]
    }
