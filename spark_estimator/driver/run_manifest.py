"""Driver: what a run's checkpoints were made with, and whether a new fit may resume them.

A finished run (its ``result.pt`` written) is trained further by a fit with the same
``run_id`` and more ``epochs``, from its last epoch checkpoint, under the same checks.

Before its training job, a fit writes ``runs/<run_id>/run.json``: the model's state (names,
shapes and dtypes), the optimizer's class and parameter groups, ``num_proc``,
``batch_size``, ``backward_passes_per_step``, ``train_steps_per_epoch``, ``random_seed``,
the rows' order (``shuffle``, ``shuffle_buffer_size``, ``bucket_by_length``),
``lr_scaling``, ``parallelism`` and the training data, because each of them changes what a
checkpoint means: weights that no longer fit, optimizer state of another kind, other shards
or another position in the data; and the loss, ``metrics``, ``loss_weights`` and
``sample_weight_col``, because they change what the history's numbers mean (a history of
two losses, and callbacks restored from the checkpoint comparing values of both). A later
fit with the same ``run_id`` resumes from the run's newest checkpoint only when all of these
are the same; a refusal names each one that changed, with its old and new value. The
data is the same when its dataset is (``data_fields``): equal rows, however the DataFrame
was built, are one dataset (``materialize`` reuses the first copy of them, its split
included); for other data the refusal says what differs: the rows per split, the rows'
content (a digest of their values), the columns, or the dataset alone.

Anything else may change between the two fits (epochs, callbacks, ...). The learning rates
too: the optimizer's hyper-parameters come back from the checkpoint, but rates other than
those the run was trained with (the optimizer's, or ``learning_rate``) replace the
checkpoint's from the first epoch trained now (``worker/loop/objects.take_new_rates``; the
history's ``lr`` shows it). A model or optimizer given as a function or class is described
by its name; losses and metrics by their class and settings or their function's name
(``described``).
"""

from __future__ import annotations

import functools
import hashlib
import sys
from typing import Any

import torch

from ..shared.spec import SPLITS, DatasetInfo
from ..store import Store


def run_manifest(model, optimizer, fields: dict[str, Any]) -> dict:
    """The description of a fit that its checkpoints depend on, without the data (known
    only after materialization, see ``data_fields``); ``fields`` holds params by name.
    ``optimizer`` is None where the model makes its own (a LightningModule)."""
    if isinstance(model, torch.nn.Module):
        manifest = {
            "model": {k: [list(v.shape), str(v.dtype)] for k, v in model.state_dict().items()}
        }
    else:  # a function builds it on each rank: its state is not known here
        manifest = {"model": {"function": _name(model)}}
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        manifest["optimizer"] = {"function": _name(optimizer)}
    elif optimizer is not None:
        manifest["optimizer"] = {
            "class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
            "param_groups": [len(g["params"]) for g in optimizer.param_groups],
        }
    return {**manifest, **fields}


def _name(function) -> str:
    """A function's qualified name (an object's class's, for a callable object)."""
    named = function if hasattr(function, "__qualname__") else type(function)
    return public_name(named)


def public_name(named) -> str:
    """A class's or function's name as its users import it: the shortest module path that
    holds it (``torch.nn.MSELoss``, not ``torch.nn.modules.loss.MSELoss``)."""
    module, qualname = named.__module__, named.__qualname__
    parts = module.split(".")
    for end in range(1, len(parts)):
        prefix = ".".join(parts[:end])
        if getattr(sys.modules.get(prefix), qualname, None) is named:
            return f"{prefix}.{qualname}"
    return f"{module}.{qualname}"


def described(value) -> Any:
    """A loss, a metric, or a list or dict of them, as the manifest records them: a module as
    its class and settings (``torch.nn.MSELoss(reduction='mean')``, buffers such as class
    weights by a digest of their values), a partial as its function and arguments, any
    other function by its name."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)):
        return [described(v) for v in value]
    if isinstance(value, dict):
        return {str(k): described(v) for k, v in value.items()}
    if isinstance(value, functools.partial):
        arguments = [repr(a) for a in value.args]
        arguments += [f"{k}={v!r}" for k, v in value.keywords.items()]
        return f"partial({described(value.func)}, {', '.join(arguments)})"
    if isinstance(value, torch.nn.Module):
        settings = [
            f"{k}={v!r}"
            for k, v in vars(value).items()
            if not k.startswith("_") and k != "training" and isinstance(v, (str, int, float))
        ]
        settings += [
            f"{k}=<{hashlib.sha256(t.detach().cpu().numpy().tobytes()).hexdigest()[:12]}>"
            for k, t in value.state_dict().items()
        ]
        return f"{public_name(type(value))}({', '.join(settings)})"
    return _name(value)


def data_fields(data: DatasetInfo) -> dict:
    """The manifest's entry for the training data: its dataset's key, rows per split,
    columns, and the digest of its rows' content where the write took one (a materialized
    dataset's: ``row_digest``)."""
    fields = {
        "dataset": data.source.get("key", data.path),
        "rows": {split: data.rows(split) for split in SPLITS},
        "columns": [f"{c.name} ({c.kind} {c.dtype})" for c in data.columns],
    }
    if (content := data.source.get("content")) is not None:
        fields["content"] = content
    return {"data": fields}


def _differences(saved: dict, manifest: dict) -> list[str]:
    keys = [k for k in manifest if k in saved]
    differ = {"data": _data_changes}
    return [k for k in keys if differ.get(k, _changed)(saved[k], manifest[k])]


def _changed(saved, now) -> bool:
    return _normal(saved) != _normal(now)


def _data_changes(saved: dict, now: dict) -> list[str]:
    """What differs between two runs' data, as a refusal names it: of the entries both
    manifests hold (a run.json written before an entry existed lacks it), the rows per
    split, the rows' content, the columns; the dataset's key only where none of those
    differ (the same rows written with another split or write options)."""
    now = _normal(now)
    common = [k for k in ("rows", "content", "columns", "dataset") if k in saved and k in now]
    changed = [k for k in common if _changed(saved[k], now[k])]
    named = []
    if "rows" in changed:
        named.append(f"rows per split (was {saved['rows']}, now {now['rows']})")
    if "content" in changed:
        was, new = saved["content"], now["content"]
        values = ": some values differ" if was["rows"] == new["rows"] else ""
        named.append(
            f"the rows' content (digest {was['digest']} of {was['rows']} rows, now "
            f"{new['digest']} of {new['rows']} rows{values})"
        )
    if "columns" in changed:
        named.append(f"columns (was {saved['columns']}, now {now['columns']})")
    if "dataset" in changed and not named:
        named.append(
            f"dataset (was {saved['dataset']}, now {now['dataset']}: other input files, or "
            "rows written with another split or write options)"
        )
    return named


def _normal(value):
    """JSON's view of a value (tuples are lists), to compare with what was read back."""
    if isinstance(value, dict):
        return {str(k): _normal(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normal(v) for v in value]
    return value


def check_resume(store: Store, run_id: str, manifest: dict, epochs: int) -> int:
    """The newest checkpointed epoch of ``run_id`` that this fit will resume from (0 when
    none); a ValueError naming ``run_id`` when the fit cannot resume that run. A fit checks
    its ``manifest`` without the data here, before any Spark job, and the data once it is
    known (``check_resume_data``)."""
    done = store.checkpoint_epochs(run_id)
    if not done:
        return 0
    _check_unchanged(store, run_id, manifest, done[-1])
    if done[-1] > epochs:
        raise ValueError(
            f"run_id: run '{run_id}' already has checkpoints up to epoch {done[-1]}, past "
            f"epochs={epochs}; raise epochs to continue it, or choose a new run_id"
        )
    return done[-1]


def check_train_further(store: Store, run_id: str, epochs: int) -> None:
    """A finished run goes on from its last epoch checkpoint when ``epochs`` asks for more;
    a ValueError naming ``run_id`` and why when it cannot."""
    done = store.checkpoint_epochs(run_id)
    if not done:
        raise ValueError(
            f"run_id: run '{run_id}' already finished in {store} and kept no epoch checkpoint "
            "to train further from (they were removed); "
            "choose a new run_id"
        )
    if done[-1] >= epochs:
        raise ValueError(
            f"run_id: run '{run_id}' already finished {done[-1]} epochs in {store}; to train "
            f"it further from its last checkpoint, fit it with epochs > {done[-1]}, or "
            "choose a new run_id"
        )


def finished_at(store: Store, run_id: str) -> int:
    """The epoch a finished run is trained further from (its last epoch checkpoint); 0
    when the run has not finished (its result is not written)."""
    if not store.exists(store.run(run_id).result):
        return 0
    return (store.checkpoint_epochs(run_id) or [0])[-1]


def check_resume_data(store: Store, run_id: str, data: DatasetInfo) -> None:
    """A ValueError naming ``run_id`` when the run has checkpoints made with other data."""
    done = store.checkpoint_epochs(run_id)
    if done:
        _check_unchanged(store, run_id, data_fields(data), done[-1])


# fields whose values are too long to show in a refusal: named only
_NAMED_ONLY = ("model",)


def _change(key: str, saved, now) -> str:
    """A changed field as a refusal names it: with its old and new value where short."""
    if key == "data":
        return f"data: {'; '.join(_data_changes(saved, now))}"
    if key in _NAMED_ONLY:
        return key

    def shown(value) -> str:
        return value if isinstance(value, str) and key == "loss" else repr(value)

    return f"{key} (was {shown(saved)}, now {shown(now)})"


def _check_unchanged(store: Store, run_id: str, manifest: dict, last_epoch: int) -> None:
    path = store.run(run_id).manifest
    saved = store.read_json(path) if store.exists(path) else {}
    changed = _differences(saved, manifest)
    if changed:
        named = "; ".join(_change(k, saved[k], _normal(manifest[k])) for k in changed)
        raise ValueError(
            f"run_id: run '{run_id}' has checkpoints up to epoch {last_epoch} made with another "
            f"{named} (see {path}); a fit resumes a run only with the same model, optimizer, "
            "loss, metrics, data and process layout. Choose a new run_id to start a new run "
            "(from the fitted weights, if you like: model=fitted.getModel())."
        )


def write_manifest(store: Store, run_id: str, manifest: dict) -> None:
    store.write_json(store.run(run_id).manifest, manifest)
