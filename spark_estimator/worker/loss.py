"""Executor: the loss of a batch and its metrics, from the model's outputs and the labels.

One loss term per label column (one model output each): ``losses[i](output_i, label_i)``,
weighted by ``loss_weights`` and summed. With per-row sample weights the loss functions run
unreduced and the batch loss is the mean over rows of ``weight * row_loss`` (a weight of 1
everywhere gives the unweighted loss). Metrics are ``fn(output, label)`` per label column,
averaged over the batch; they never see gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..spec import ColumnSpec


def as_outputs(output) -> list[torch.Tensor]:
    """A model's return value as a list of tensors, one per output."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)) and all(isinstance(o, torch.Tensor) for o in output):
        return list(output)
    raise TypeError(
        f"model: forward() must return a tensor or a tuple of tensors, got {type(output).__name__}"
    )


def align_label(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """A float label with as many values as its output (e.g. [B] for an output [B, 1]) in
    the output's shape, so regression losses do not broadcast silently."""
    if label.is_floating_point() and label.shape != output.shape:
        if label.numel() == output.numel():
            return label.view_as(output)
    return label


def unreduced(loss_fn):
    """``loss_fn`` returning one value per row: a loss module with a ``reduction`` attribute
    is switched to ``reduction="none"`` (this is the executor's own copy); a plain function
    must already return per-row values (checked on the first batch)."""
    if isinstance(loss_fn, torch.nn.Module) and hasattr(loss_fn, "reduction"):
        loss_fn.reduction = "none"
    return loss_fn


def _per_row(values: torch.Tensor, rows: int, label: str) -> torch.Tensor:
    if values.dim() == 0 or values.shape[0] != rows:
        raise ValueError(
            f"sample_weight_col: the loss for label column '{label}' returned shape "
            f"{tuple(values.shape)} for {rows} rows; with sample weights it must return one "
            "value per row (a loss module with a `reduction` attribute is switched to "
            "reduction='none' automatically; a loss function must do that itself)"
        )
    return values.reshape(rows, -1).mean(dim=1)


class BatchLoss:
    """The training loss of a batch: ``(outputs, labels, sample_weight) -> scalar``."""

    def __init__(
        self,
        losses: Sequence[Callable],
        label_specs: Sequence[ColumnSpec],
        loss_weights: Sequence[float] | None = None,
        weighted_rows: bool = False,
    ):
        self.losses = [unreduced(f) for f in losses] if weighted_rows else list(losses)
        self.label_specs = list(label_specs)
        self.loss_weights = list(loss_weights) if loss_weights else [1.0] * len(label_specs)

    def __call__(self, outputs, labels, sample_weight: torch.Tensor | None = None):
        specs = self.label_specs
        if len(outputs) != len(labels):
            raise ValueError(
                f"label_cols: the model returned {len(outputs)} outputs for {len(labels)} "
                f"label columns {[s.name for s in specs]}; return one output per label column"
            )
        rows = len(labels[0])
        if rows == 0:  # an empty batch still joins DDP's allreduce, with a zero gradient
            return sum(o.sum() for o in outputs) * 0.0
        total = None
        for loss_fn, weight, output, label, spec in zip(
            self.losses, self.loss_weights, outputs, labels, specs
        ):
            label = align_label(output, label)
            try:
                term = loss_fn(output, label)
            except Exception as e:
                raise ValueError(
                    f"loss: failed on output of shape {tuple(output.shape)} and label column "
                    f"'{spec.name}' of shape {tuple(label.shape)} ({type(e).__name__}: {e})"
                ) from e
            if sample_weight is not None:
                term = (_per_row(term, rows, spec.name) * sample_weight.to(term.dtype)).mean()
            term = term * weight if weight != 1.0 else term
            total = term if total is None else total + term
        return total


def batch_metrics(metrics: dict[str, Callable], outputs, labels) -> list[torch.Tensor]:
    """Each metric's batch mean (as 0-d float64 tensors), in ``spec.metric_keys`` order."""
    values = []
    with torch.no_grad():
        for fn in metrics.values():
            for output, label in zip(outputs, labels):
                value = fn(output.detach(), align_label(output, label))
                if not isinstance(value, torch.Tensor):
                    value = torch.as_tensor(value, device=output.device)
                values.append(value.double().mean())
    return values
