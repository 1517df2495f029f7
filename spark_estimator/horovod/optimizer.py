"""Executor: Horovod's ``DistributedOptimizer``: the user's optimizer, gradients averaged
across ranks before its step.

The returned object is of a class made on the fly: a subclass of the user's optimizer's
class, so ``isinstance`` checks, LR schedulers and ``state_dict`` work as before. It shares
the user's optimizer's parameter groups and state (no constructor is called again), so an
LR scheduler made before the wrap, on the user's optimizer, still sets the rates the
wrapped one steps with; the step such a scheduler put on the user's optimizer (to watch
its calls) is not taken over, the reduction would be skipped.

Each parameter's gradient hook (``register_post_accumulate_grad_hook``) counts the
backward passes; once a parameter's gradient has accumulated ``backward_passes_per_step``
times it is ready. Gradients are fused in buckets (parameters in reverse order, as they
tend to finish in backward, up to ``BUCKET_BYTES`` each) and a bucket's allreduce starts,
asynchronously, as soon as it and every bucket before it are ready: every rank starts the
same collectives in the same order while backward still runs. ``synchronize()`` starts
the rest and writes the results into ``.grad``.

With ``op=Adasum`` the gradients are not reduced: ``step()`` takes the local step, then
combines the ranks' parameter updates (new weights minus old) with Adasum and applies the
result on every rank, as Horovod's Adasum optimizer does.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from contextlib import contextmanager

import torch

from .collectives import Reduction, grouped_allreduce
from .compression import Compression, Compressor
from .core import Adasum, Average, reduce_op
from .errors import peer_errors
from .process_sets import ProcessSet, global_process_set, scope

BUCKET_BYTES = 25 * 2**20


def DistributedOptimizer(  # noqa: N802 (Horovod's name)
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op=Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups=None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that its ``step()`` first reduces the gradients across ranks.

    The returned optimizer is of a subclass of ``optimizer``'s class and shares its
    parameter groups and state. Gradients are fused in buckets whose allreduces start,
    asynchronously, while backward still runs; ``step()`` waits for them and writes the
    results into ``.grad`` (or ``synchronize()`` does, e.g. before clipping, and then
    ``step()`` runs inside ``skip_synchronize()``). With ``op=Adasum`` the gradients are
    not reduced: ``step()`` takes the local step, then combines the ranks' parameter
    updates with Adasum, as Horovod's Adasum optimizer does.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        The optimizer to wrap; the result shares its parameter groups and state.
    named_parameters : iterable of (str, torch.Tensor), optional
        ``model.named_parameters()``: names for the gradients' allreduces (in error
        messages and a timeline); each must be unique, and every parameter of the
        optimizer named.
    compression : hvd.Compression.none, fp16 or bf16, default none
        How the gradients travel.
    backward_passes_per_step : int, default 1
        How many backward passes accumulate locally before the gradients are reduced.
    op : hvd.ReduceOp, default hvd.Average
        Average, Sum, Min, Max or Product of the gradients; Adasum combines the updates
        instead.
    gradient_predivide_factor : float, default 1.0
        f splits Average's division: gradients are multiplied by 1/f before the sum and by
        f/size() after it (with ``op=Average`` only).
    num_groups : int, default 0
        Horovod's older name of an int ``groups``.
    groups : int or list of lists of torch.Tensor, optional
        Which gradients travel together (one fused allreduce each): an int k cuts the
        parameters into k groups of near-equal counts; a list of lists of parameters makes
        each list a group, every other parameter its own; None (or 0) fuses by size
        (``BUCKET_BYTES``). A group's tensors of different dtypes travel in one allreduce
        per dtype. Not with Adasum.
    sparse_as_dense : bool, default False
        Sparse gradients are reduced as dense tensors whatever it says (the same values;
        ``.grad`` becomes dense).
    process_set : hvd.ProcessSet, default hvd.global_process_set
        The ranks the gradients are reduced over (an Average divides by its size); a rank
        outside it is refused here, as its first reduction would be.

    Returns
    -------
    torch.optim.Optimizer
        The distributed optimizer, an instance of a subclass of ``optimizer``'s class (so
        ``isinstance`` checks, LR schedulers and ``state_dict`` work as before), with
        ``synchronize()``, ``skip_synchronize()`` and ``set_backward_passes_per_step()``.

    Raises
    ------
    TypeError
        ``optimizer`` is not a ``torch.optim.Optimizer``; a ``compression``, ``groups`` or
        ``sparse_as_dense`` of another type.
    ValueError
        An unknown ``op``; ``backward_passes_per_step`` < 1; ``gradient_predivide_factor``
        <= 0, or other than 1 without Average; ``groups`` that cannot work (or with
        Adasum); ``named_parameters`` that do not name every parameter once; this rank
        outside ``process_set``; before ``hvd.init()``.

    Examples
    --------
    >>> import spark_estimator.horovod as hvd
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())  # doctest: +SKIP
    >>> opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    ...                                                                 # doctest: +SKIP
    >>> loss_fn(model(x), y).backward()                                 # doctest: +SKIP
    >>> opt.step()                                                      # doctest: +SKIP
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer)}")
    op = reduce_op(op)
    _check_passes(backward_passes_per_step)
    if not gradient_predivide_factor > 0:
        raise ValueError(
            f"gradient_predivide_factor: must be > 0, got {gradient_predivide_factor!r}"
        )
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError(f"gradient_predivide_factor: only with op=Average, not {op.name.title()}")
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError(
            f"compression: expected hvd.Compression.none/fp16/bf16, got {compression!r}"
        )
    world = scope(process_set, "DistributedOptimizer").size  # raises outside the set
    names = _parameter_names(optimizer, named_parameters)
    if not isinstance(sparse_as_dense, bool):
        raise TypeError(f"sparse_as_dense: expected True or False, got {sparse_as_dense!r}")
    fused = _groups(optimizer, groups if groups is not None else num_groups)
    if fused is not None and op == Adasum:
        raise ValueError("groups: Adasum combines each parameter's update on its own")
    mixin = _AdasumUpdates if op == Adasum else _GradientAllreduce
    cls = type(type(optimizer).__name__, (mixin, type(optimizer)), {})
    distributed = cls.__new__(cls)
    state = dict(optimizer.__dict__)
    # an LR scheduler made before the wrap replaced the optimizer's step on the instance
    # (torch's patch_track_step_called): a step of the user's optimizer, which would skip
    # the reduction; the class's step is ours, and it tells that scheduler of each step
    scheduled = state.pop("step", None)
    distributed.__dict__.update(state)
    distributed._setup(
        names,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        process_set,
        world,
    )
    if fused is not None:
        distributed._group(fused)
    if scheduled is not None:
        distributed._stepped_for = optimizer
    return distributed


def _groups(optimizer, groups) -> list[list[torch.Tensor]] | None:
    """The parameter groups ``groups`` asks to fuse (see DistributedOptimizer), or None."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    whole = isinstance(groups, int) and not isinstance(groups, bool)
    if groups is None or (whole and groups == 0):
        return None
    if whole:
        if groups < 0:
            raise ValueError(f"groups: must be >= 0, got {groups}")
        cut = [len(params) * i // groups for i in range(groups + 1)]
        return [params[a:b] for a, b in zip(cut, cut[1:]) if b > a]
    if not isinstance(groups, (list, tuple)) or not all(
        isinstance(g, (list, tuple)) for g in groups
    ):
        raise TypeError(f"groups: expected an int or a list of lists of parameters, got {groups!r}")
    known, placed = {id(p) for p in params}, set()
    for group in groups:
        for p in group:
            if id(p) not in known:
                raise ValueError("groups: a parameter that the optimizer does not train")
            if id(p) in placed:
                raise ValueError("groups: a parameter in two groups")
            placed.add(id(p))
    return [list(g) for g in groups if g] + [[p] for p in params if id(p) not in placed]


def _parameter_names(optimizer, named_parameters) -> dict[int, str]:
    """id(parameter) -> its name, for every parameter of the optimizer."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        return {
            id(p): f"allreduce.noname.{g}.{i}"
            for g, group in enumerate(optimizer.param_groups)
            for i, p in enumerate(group["params"])
        }
    named = list(named_parameters)
    if not all(isinstance(pair, tuple) and len(pair) == 2 for pair in named):
        raise ValueError(
            "named_parameters: expected (name, parameter) pairs, as model.named_parameters() gives"
        )
    seen, duplicates = set(), set()
    for name, _ in named:
        (duplicates if name in seen else seen).add(name)
    if duplicates:
        raise ValueError(f"named_parameters: names must be unique; repeated: {sorted(duplicates)}")
    names = {id(p): name for name, p in named}
    unnamed = sum(id(p) not in names for p in params)
    if unnamed:
        raise ValueError(
            f"named_parameters: {unnamed} of the optimizer's {len(params)} parameters have no "
            "name there (pass the named_parameters() of the model the optimizer trains)"
        )
    return names


def _check_passes(passes) -> None:
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"backward_passes_per_step: must be an int >= 1, got {passes!r}")


class _Distributed:
    """What both kinds share: the backward-pass count per parameter, and its checks."""

    def _setup(self, names, compression, backward_passes_per_step, op, predivide, pset, world):
        self._names = names
        self.process_set = pset
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = predivide
        self._should_synchronize = True
        self._synchronized = False
        self._stepped_for = None  # the user's optimizer, when a scheduler watches its steps
        self._params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._passes = {id(p): 0 for p in self._params}
        self._world = world
        if self._world > 1:
            for p in self._params:
                p.register_post_accumulate_grad_hook(self._accumulated)

    def _accumulated(self, p: torch.Tensor) -> None:
        passes = self._passes[id(p)] + 1
        if passes > self.backward_passes_per_step:
            raise RuntimeError(
                f"the gradient of {self._names[id(p)]!r} was computed more than "
                f"backward_passes_per_step={self.backward_passes_per_step} times before "
                "optimizer.step(): raise backward_passes_per_step to accumulate gradients "
                "locally"
            )
        self._passes[id(p)] = passes
        if passes == self.backward_passes_per_step:
            self._ready(p)

    def _ready(self, p: torch.Tensor) -> None:
        """``p``'s gradient has accumulated all its backward passes."""

    def _stepping(self) -> None:
        """What a scheduler made before the wrap counts on: that the optimizer it holds
        (the user's) marks its steps (torch warns of ``lr_scheduler.step()`` before
        ``optimizer.step()`` otherwise, and its schedule would skip a value)."""
        if self._stepped_for is not None:
            self._stepped_for._opt_called = True

    def _reset_passes(self) -> None:
        self._passes = dict.fromkeys(self._passes, 0)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Reduce each gradient after ``passes`` backward passes from now on, as Horovod's;
        the passes of a step under way count again from 0."""
        _check_passes(passes)
        self.backward_passes_per_step = passes
        self._reset_passes()

    @contextmanager
    def skip_synchronize(self):
        """``step()`` inside this block does not synchronize (call ``synchronize()``
        before it, e.g. to clip the reduced gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def zero_grad(self, *args, **kwargs):
        if any(self._passes.values()):
            raise RuntimeError(
                "optimizer.zero_grad() after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(): the gradients being reduced would be lost"
            )
        return super().zero_grad(*args, **kwargs)


class _GradientAllreduce(_Distributed):
    def _setup(self, *args):
        super()._setup(*args)
        self._buckets: list[list[torch.Tensor]] = []
        size_of = {}
        for p in reversed(self._params):
            last = self._buckets[-1] if self._buckets else None
            nbytes = p.numel() * p.element_size()
            if (
                last is None
                or (last[0].dtype, last[0].device) != (p.dtype, p.device)
                or size_of[id(last[0])] + nbytes > BUCKET_BYTES
            ):
                self._buckets.append([p])
                size_of[id(p)] = nbytes
            else:
                last.append(p)
                size_of[id(last[0])] += nbytes
        self._index()

    def _group(self, groups: list[list[torch.Tensor]]) -> None:
        """Fuse ``groups`` (each split by dtype and device), in the order backward tends
        to finish them (that of their last parameter, reversed)."""
        position = {id(p): i for i, p in enumerate(self._params)}
        buckets = []
        for group in groups:
            kinds: dict[tuple, list[torch.Tensor]] = {}
            for p in group:
                kinds.setdefault((p.dtype, p.device), []).append(p)
            buckets.extend(kinds.values())
        self._buckets = sorted(buckets, key=lambda b: -max(position[id(p)] for p in b))
        self._index()

    def _index(self) -> None:
        self._bucket_of = {id(p): b for b, bucket in enumerate(self._buckets) for p in bucket}
        self._ready_count = [0] * len(self._buckets)
        self._reductions: list[Reduction] = []
        if self.op == Average:
            self._scales = (1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor)
        else:
            self._scales = (1.0, 1.0)

    def _ready(self, p):
        self._ready_count[self._bucket_of[id(p)]] += 1
        while len(self._reductions) < len(self._buckets):
            b = len(self._reductions)
            if self._ready_count[b] < len(self._buckets[b]):
                break
            self._start(b)

    def _start(self, b: int) -> None:
        grads = []
        for p in self._buckets[b]:
            if p.grad is None:  # unused here; another rank may have a gradient for it
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                p.grad = p.grad.to_dense()
            grads.append(p.grad)
        name = self._names[id(self._buckets[b][0])]
        self._reductions.append(
            Reduction(grads, self.op, self._compression, *self._scales, name, self.process_set)
        )

    @peer_errors
    def synchronize(self) -> None:
        """Finish reducing every gradient (starting those not started yet) and write the
        results into ``.grad``."""
        if self._world > 1:
            for b in range(len(self._reductions), len(self._buckets)):
                self._start(b)
            with torch.no_grad():
                for bucket, reduction in zip(self._buckets, self._reductions):
                    for p, reduced in zip(bucket, reduction.wait()):
                        p.grad.copy_(reduced)
            self._reductions.clear()
            self._ready_count = [0] * len(self._buckets)
            self._reset_passes()
        self._synchronized = True

    @peer_errors
    def step(self, closure=None):
        self._stepping()
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() after optimizer.synchronize() outside "
                    "optimizer.skip_synchronize(): the gradients are reduced twice",
                    stacklevel=2,
                )
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    # the base class's step is already wrapped with the optimizer's step hooks; wrapping
    # this one too (as Optimizer.__setstate__ and zero_grad would) would run them twice
    step.hooked = True


class _AdasumUpdates(_Distributed):
    @peer_errors
    def synchronize(self) -> None:
        """Nothing to do: with Adasum the updates are combined in ``step()``."""
        self._synchronized = True

    @peer_errors
    def step(self, closure=None):
        self._stepping()
        if self._world == 1:
            return super().step(closure)
        with torch.no_grad():
            starts = [p.detach().clone() for p in self._params]
        loss = super().step(closure)
        with torch.no_grad():
            deltas = [p.detach() - start for p, start in zip(self._params, starts)]
            combined = grouped_allreduce(
                deltas, op=Adasum, compression=self._compression, process_set=self.process_set
            )
            for p, start, delta in zip(self._params, starts, combined):
                p.copy_(start.add_(delta))
        self._reset_passes()
        self._synchronized = False
        return loss

    step.hooked = True
