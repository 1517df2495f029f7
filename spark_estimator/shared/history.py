"""A fit's history records as scalars by name: what TensorBoard (on rank 0) and MLflow (on
the driver) log of each epoch."""

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
    return values
