"""Executor: the loss of a batch and its metrics, from the model's outputs and the labels.

One loss term per label column (one model output each): ``losses[i](output_i, label_i)``,
weighted by ``loss_weights`` and summed. With per-row sample weights the loss functions run
unreduced and the batch loss is the mean over rows of ``weight * row_loss`` (a weight of 1
everywhere gives the unweighted loss). An integer label column (loaded as int64 class
indices) whose loss fails on integers but works on floats, e.g. 0/1 labels with BCELoss, is
given to that loss as floats in the output's dtype from then on. Metrics are
``fn(output, label)`` per label column, averaged over the batch; they never see gradients.
The driver runs the same on a probe batch before training (``check_loss``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import torch

from ...shared.spec import ColumnSpec


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


def float_label(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """An integer label as a float label in ``output``'s dtype, aligned to it."""
    return align_label(output, label.to(output.dtype))


def _takes_reduction(fn) -> bool:
    try:
        return "reduction" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (some builtins)
        return False


def unreduced(loss_fn):
    """``loss_fn`` returning one value per row: a loss module with a ``reduction`` attribute
    is switched to ``reduction="none"`` (this is the executor's own copy); a function with a
    ``reduction`` parameter (``torch.nn.functional``'s losses) is called with
    ``reduction="none"``; any other function must already return per-row values (checked
    on the first batch, and on the driver's probe batch)."""
    if isinstance(loss_fn, torch.nn.Module):
        if hasattr(loss_fn, "reduction"):
            loss_fn.reduction = "none"
        return loss_fn
    if _takes_reduction(loss_fn):
        return functools.partial(loss_fn, reduction="none")
    return loss_fn


def _per_row(values: torch.Tensor, rows: int, label: str) -> torch.Tensor:
    if values.dim() == 0 or values.shape[0] != rows:
        raise ValueError(
            f"sample_weight_col: the loss for label column '{label}' returned shape "
            f"{tuple(values.shape)} for {rows} rows; with sample weights it must return one "
            "value per row (a loss module with a `reduction` attribute, or a function with a "
            "`reduction` parameter, gets reduction='none' automatically; any other loss "
            "function must return per-row values itself)"
        )
    return values.reshape(rows, -1).mean(dim=1)


class LossFailed(ValueError):
    """The user's loss raised on a batch (as opposed to the checks around it): the loss
    of label column ``index``."""

    def __init__(self, message: str, index: int = 0):
        super().__init__(message)
        self.index = index


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
        # label columns whose integers this loss takes as floats (found on the first batch)
        self.float_labels: set[int] = set()

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
        for i, (loss_fn, weight, output, label, spec) in enumerate(
            zip(self.losses, self.loss_weights, outputs, labels, specs)
        ):
            term = self._term(i, loss_fn, output, label, spec)
            if sample_weight is not None:
                term = (_per_row(term, rows, spec.name) * sample_weight.to(term.dtype)).mean()
            term = term * weight if weight != 1.0 else term
            total = term if total is None else total + term
        return total

    def _term(self, i: int, loss_fn, output: torch.Tensor, label: torch.Tensor, spec):
        """``loss_fn`` on one label column; an integer label it fails on is retried once
        as floats, and taken as floats from then on if that works."""
        cast = i in self.float_labels
        aligned = float_label(output, label) if cast else align_label(output, label)
        try:
            return loss_fn(output, aligned)
        except Exception as e:
            if not cast and not label.is_floating_point() and output.is_floating_point():
                try:
                    term = loss_fn(output, float_label(output, label))
                except Exception:
                    pass  # not the integers: report the first failure
                else:
                    self.float_labels.add(i)
                    return term
            raise LossFailed(
                f"loss: failed on output of shape {tuple(output.shape)} and label column "
                f"'{spec.name}' of shape {tuple(aligned.shape)} ({type(e).__name__}: {e})",
                i,
            ) from e


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
