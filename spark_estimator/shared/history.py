"""A fit's history records as scalars by name: what TensorBoard (on rank 0) and MLflow (on
the driver) log of each epoch; and an epoch's timings as shares (the progress bar's)."""

from __future__ import annotations


def epoch_scalars(record: dict) -> dict[str, float]:
    """The scalars of one history record, by TensorBoard tag."""
    values = {}
    for split in ("train", "validation"):
        for name, value in (record.get(split) or {}).items():
            if value is not None:
                values[f"{split}/{name}"] = float(value)
    for group, lr in enumerate(record.get("lr") or []):
        values[f"lr/group_{group}"] = float(lr)
    for kind, per_rank in (record.get("seconds") or {}).items():
        values[f"seconds/{kind}"] = max(per_rank)  # the slowest rank's
    return values


def time_shares(record: dict) -> dict[str, float] | None:
    """Of an epoch's training seconds summed over ranks: the shares spent waiting for data,
    computing and communicating (None for a record without timings)."""
    seconds = record.get("seconds")
    total = sum(seconds["train"]) if seconds else 0
    if not total:
        return None
    return {k: sum(seconds[k]) / total for k in ("data", "compute", "communication")}
