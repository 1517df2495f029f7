"""``hvd.elastic``: training state that survives a lost rank, committed to the run's store.

    state = hvd.elastic.TorchState(model, optimizer, epoch=1, batch=0)
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs + 1):
            ...
            state.commit()

    train(state)

``state.commit()`` keeps a copy of the state in memory and, in a task of ``run`` (or of
the launcher), rank 0 writes it to ``runs/<run_id>/elastic/commit.pt`` of the run's store,
atomically. When a rank or its executor is lost, ``run`` starts the job again (at most
``max_restarts`` times, only for launches that entered ``hvd.elastic.run``: rank 0 marks
that in ``runs/<run_id>/elastic/launches/``); ``hvd.elastic.run`` then loads the last
commit on rank 0, broadcasts it to every rank and calls the reset callbacks, so a failure
repeats at most the work since the last commit. Outside any task (a script run with
plain ``python``) commits stay in memory.

A commit in the store is loaded as checkpoints are, without running code
(``torch.load(weights_only=True)``): tensors, numbers, strings and plain containers, and
the classes the script allowed with ``torch.serialization.add_safe_globals``. So rank 0's
first ``commit()`` of a state holding any other object (a class instance the script
defined, a NumPy array) fails naming the attribute, instead of writing a commit that the
next launch could not load; and a commit that holds such objects anyway (written by
someone else) is refused, never unpickled.

Growing back: while a launch that entered ``hvd.elastic.run`` has fewer ranks than the
run's largest size and the cluster offers more task slots, the driver writes a growth
request to the run's ``elastic/grow.json`` (its ``request_growth``).
``check_host_updates()`` (called by ``commit()`` after the commit is written, and callable
by the script, as in Horovod) has rank 0 read it and broadcast the decision, so every rank raises
``HostsUpdatedInterrupt`` at the same call; called directly, it first commits the state as
it is then, which is what Horovod's ranks keep on such an interrupt. The processes of a
Spark barrier job are fixed while it runs, so ``hvd.elastic.run`` then ends the launch on
every rank (``EndLaunchToGrow``: the task ends without an error), and the driver starts the
next one larger: it restores the commit and calls the reset callbacks with the new
``hvd.size()``. A rank lost mid-launch ends the whole Spark stage: the survivors cannot go
on from their memory as Horovod's do after a ``HorovodInternalError``, so the job starts
again from the last commit in the store (docs/horovod.md says how the two differ).
"""

from __future__ import annotations

import copy
import functools
import pickle
import re
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..shared.serialization import state_from_bytes, state_to_bytes
from ..worker.comm import rendezvous
from ..worker.comm.ranks import RankInfo
from ..worker.run_task import EndLaunchToGrow, current_run
from .elastic_sampler import ElasticSampler as ElasticSampler  # hvd.elastic.ElasticSampler


class HostsUpdatedInterrupt(RuntimeError):
    """The driver asked the job to grow (see the module); Horovod's, with its
    ``skip_sync`` (whether the ranks may skip ``sync()`` before going on)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("the driver asked the job to grow: more task slots are offered")
        self.skip_sync = skip_sync


def _rank_info() -> RankInfo:
    if not dist.is_initialized():
        rendezvous.init_default_group()
    return rendezvous.current_rank_info()


def _broadcast_object(obj):
    """Rank 0's ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=_rank_info().device)
    return box[0]


class State:
    """State that is committed, restored and synchronised across ranks; subclasses say
    what it holds (``save``, ``restore``, ``sync``, ``state_dict``, ``load_state_dict``)."""

    def __init__(self):
        self._reset_callbacks: list[Callable[[], None]] = []
        self._loadable: set[frozenset] = set()  # the kinds of commits found loadable

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Functions (no arguments) called after the state was reset to a commit of an
        earlier launch, in the order registered."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state in memory and (rank 0, in a ``run`` task) in the run's store,
        atomically; then check for a growth request as ``check_host_updates()`` does
        (without committing again)."""
        self.save()
        self._write_commit()
        if _growth_requested():
            raise HostsUpdatedInterrupt()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank when the driver asked the job to
        grow, after committing the state as it is now (see the module); a collective, so
        every rank calls it at the same point."""
        if _growth_requested():
            self.save()
            self._write_commit()
            raise HostsUpdatedInterrupt()

    def _write_commit(self) -> None:
        """Rank 0, in a ``run`` task: the last ``save()`` to the run's store, atomically."""
        spec = current_run()
        if spec is not None and _rank_info().rank == 0:
            saved = self.state_dict()
            data = state_to_bytes(saved)
            self._check_loadable(saved, data)
            with spec.store.open_atomic(spec.store.run(spec.run_id).commit) as f:
                f.write(data)

    def _check_loadable(self, saved: dict, data: bytes) -> None:
        """A TypeError naming the attributes of ``saved`` (written as ``data``) that a
        weights-only load refuses; tried once for each kind of commit (the types it holds),
        not at every commit."""
        kinds = frozenset(_types(saved, set()))
        if kinds in self._loadable:
            return
        try:
            state_from_bytes(data)
        except pickle.UnpicklingError as e:
            raise _unloadable(saved, e) from None
        self._loadable.add(kinds)

    def sync(self) -> None:
        """Make every rank's state rank 0's; then save it in memory."""
        self._sync()
        self.save()

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def _sync(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, saved: dict) -> None:
        raise NotImplementedError


class ObjectState(State):
    """State of picklable attributes, read and written as ``state.<name>``. An attribute
    with ``state_dict()`` and ``load_state_dict()`` (an ``ElasticSampler``, as in
    ``TorchState(model, optimizer, train_sampler=sampler)``) stays the same object: its
    ``state_dict()`` is what is saved, committed and synchronised, and it takes saved state
    back through ``load_state_dict`` (a sampler then re-cuts its epoch over the ranks)."""

    def __init__(self, **attributes):
        super().__init__()
        self._names = list(attributes)
        self.__dict__.update(attributes)
        self._saved = self._snapshot()

    def _attributes(self) -> dict:
        return {name: getattr(self, name) for name in self._names}

    def _snapshot(self) -> dict:
        return {
            name: copy.deepcopy(value.state_dict() if _stateful(value) else value)
            for name, value in self._attributes().items()
        }

    def _apply(self, values: dict) -> None:
        for name, value in values.items():
            current = getattr(self, name, None)
            if _stateful(current):
                current.load_state_dict(copy.deepcopy(value))
            else:
                setattr(self, name, copy.deepcopy(value))

    def save(self) -> None:
        """Keep a copy of the attributes in memory (what ``restore()`` returns to)."""
        self._saved = self._snapshot()

    def restore(self) -> None:
        """Put the attributes back as they were at the last ``save()`` / ``commit()``."""
        self._apply(self._saved)

    def _sync(self) -> None:
        self._apply(_broadcast_object(self._snapshot()))

    def state_dict(self) -> dict:
        return {"attributes": self._saved}

    def load_state_dict(self, saved: dict) -> None:
        self._saved = saved["attributes"]
        self.restore()


class TorchState(ObjectState):
    """The state of a ``model`` and an ``optimizer`` with attributes (see the module for
    what a commit in the store can hold).

    What ``hvd.elastic.run`` restores after a lost rank: ``commit()`` keeps a copy in
    memory and, in a task of ``run`` (or of the launcher), rank 0 writes it to the run's
    store; ``restore()`` goes back to the last ``save()`` or ``commit()``; ``sync()`` makes
    every rank's state rank 0's. Attributes are read and written as ``state.<name>``; one
    with ``state_dict()`` and ``load_state_dict()`` (an ``ElasticSampler``) stays the same
    object and is saved through its ``state_dict()``.

    Parameters
    ----------
    model : torch.nn.Module, optional
        Its ``state_dict()`` is saved, committed and broadcast.
    optimizer : torch.optim.Optimizer, optional
        Its ``state_dict()`` likewise.
    **attributes
        Tensors, numbers, strings and plain containers of them (``epoch=1, batch=0``;
        classes allowed with ``torch.serialization.add_safe_globals`` too: a commit in the
        store loads weights-only), or objects with ``state_dict()`` and
        ``load_state_dict()``.

    Examples
    --------
    >>> state = hvd.elastic.TorchState(model, optimizer, epoch=1, batch=0)  # doctest: +SKIP
    >>> state.register_reset_callbacks([on_reset])                      # doctest: +SKIP
    >>> state.commit()                                                  # doctest: +SKIP
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer=None, **attributes):
        self.model, self.optimizer = model, optimizer
        self._saved_model = self._saved_optimizer = None
        super().__init__(**attributes)
        self.save()

    def save(self) -> None:
        super().save()
        if self.model is not None:
            self._saved_model = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._saved_optimizer = copy.deepcopy(self.optimizer.state_dict())

    def restore(self) -> None:
        super().restore()
        if self.model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._saved_optimizer)

    def _sync(self) -> None:
        super()._sync()
        if self.model is not None:
            with torch.no_grad():
                for tensor in self.model.state_dict().values():
                    work = tensor.to(_rank_info().device)
                    dist.broadcast(work, src=0)
                    tensor.copy_(work)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(_broadcast_object(self.optimizer.state_dict()))

    def state_dict(self) -> dict:
        return {
            **super().state_dict(),
            "model": self._saved_model,
            "optimizer": self._saved_optimizer,
        }

    def load_state_dict(self, saved: dict) -> None:
        self._saved_model, self._saved_optimizer = saved["model"], saved["optimizer"]
        super().load_state_dict(saved)


def _stateful(value) -> bool:
    """Whether ``value`` saves and loads its own state (not a plain picklable value)."""
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def _types(value, found: set) -> set:
    """The types of ``value`` and of everything in its plain containers."""
    found.add(type(value))
    if isinstance(value, dict):
        for key, item in value.items():
            _types(key, found)
            _types(item, found)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            _types(item, found)
    return found


def _refused(value) -> str | None:
    """What a weights-only load refuses in ``value`` (torch's name of it), or None."""
    try:
        state_from_bytes(state_to_bytes(value))
    except pickle.UnpicklingError as e:
        if isinstance(value, (dict, list, tuple, set, frozenset)):  # what is inside it
            return _global_refused(e) or type(value).__qualname__
        return f"a {type(value).__module__}.{type(value).__qualname__}"
    return None


def _global_refused(error: Exception) -> str | None:
    """The global (module.name) a weights-only load refused, as torch's error names it."""
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
    return found.group(1) if found else None


def _unloadable(saved: dict, error: Exception) -> TypeError:
    parts = {f"attribute '{k}'": v for k, v in saved.get("attributes", {}).items()}
    parts.update({name: saved[name] for name in ("model", "optimizer") if name in saved})
    refused = {part: what for part, value in parts.items() if (what := _refused(value))}
    if not refused:  # no part alone: the whole state's
        refused = {"the state": _global_refused(error) or "objects of other types"}
    classes = sorted({w.rsplit(".", 1)[-1] for w in refused.values() if "numpy" not in w})
    allow = f"[{', '.join(classes)}]" if classes else "[YourClass]"
    return TypeError(
        "hvd.elastic: cannot commit "
        + ", ".join(f"{part} (it holds {what})" for part, what in refused.items())
        + ": commits are loaded without running code (torch.load(weights_only=True)), "
        "which takes tensors, numbers, strings and plain containers. Keep such values in "
        "the state (a NumPy array as a tensor), give the object state_dict() and "
        "load_state_dict() returning them, or allow its class where the script starts: "
        f"torch.serialization.add_safe_globals({allow})"
    )


def _growth_requested() -> bool:
    """Whether this launch should end for the job to grow: rank 0 reads the run's request
    (one for this launch's size) and broadcasts it. Outside a ``run`` task, never."""
    spec = current_run()
    if spec is None:
        return False
    info = _rank_info()
    asked = 0.0
    if info.rank == 0:
        store, path = spec.store, spec.store.run(spec.run_id).grow
        asked = float(store.exists(path) and store.read_json(path)["from"] == info.world_size)
    flag = torch.tensor([asked], device=info.device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _restore_commit(state: State) -> bool:
    """Load the run's last commit into ``state`` on rank 0; whether there was one (on
    every rank)."""
    spec = current_run()
    saved = None
    if spec is not None and _rank_info().rank == 0:
        run = spec.store.run(spec.run_id)
        spec.store.write_bytes(run.elastic_launch(spec.launch_id), b"")
        if spec.store.exists(run.commit):
            data = spec.store.read_bytes(run.commit)
            try:
                saved = state_from_bytes(data)
            except pickle.UnpicklingError as e:
                raise pickle.UnpicklingError(
                    f"hvd.elastic: refused to load the run's last commit {run.commit}: it "
                    "holds objects other than tensors and plain containers, and loading "
                    "those could run any code (it is loaded with "
                    "torch.load(weights_only=True); this library's commit() writes no "
                    "such file). Classes your own state holds: allow them with "
                    "torch.serialization.add_safe_globals([...]) before hvd.elastic.run; "
                    f"a file you did not write: remove it. (refused: {_global_refused(e)})"
                ) from e
            state.load_state_dict(saved)
    return bool(_broadcast_object(saved is not None))


def run(func: Callable) -> Callable:
    """Decorate a training function so that it survives a lost rank and grows with the job.

    Before ``func`` runs, every rank's ``state`` becomes the run's last commit (then the
    reset callbacks are called) or, without one, rank 0's state. A
    ``HostsUpdatedInterrupt`` ends the launch in a ``run`` task, for the driver to start a
    larger one (see the module); elsewhere (one raised by the script) it resynchronises,
    unless its ``skip_sync``, calls the reset callbacks and calls ``func`` again, as
    Horovod's. A ``HorovodInternalError`` (a peer lost) propagates: ``run`` starts the job
    again from the last commit (at most ``max_restarts`` times).

    Parameters
    ----------
    func : callable
        ``func(state, *args, **kwargs)``, whose first argument is an ``hvd.elastic.State``
        (a ``TorchState``) it commits as it goes.

    Returns
    -------
    callable
        The wrapped function, called as ``func`` is (``train(state, ...)``); it returns
        what ``func`` returns.

    Examples
    --------
    >>> @hvd.elastic.run                                                # doctest: +SKIP
    ... def train(state):
    ...     for state.epoch in range(state.epoch, epochs + 1):
    ...         train_one_epoch(model, optimizer)
    ...         state.commit()
    >>> train(hvd.elastic.TorchState(model, optimizer, epoch=1))        # doctest: +SKIP
    """

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        if _restore_commit(state):
            state.sync()
            state.on_reset()
        else:
            state.sync()
        while True:
            try:
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as interrupt:
                if current_run() is not None:
                    raise EndLaunchToGrow() from None
                if not interrupt.skip_sync:
                    state.sync()
                state.on_reset()

    return wrapper
