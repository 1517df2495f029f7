"""Executor: an FSDP model's and optimizer's state in the store, one shard per rank.

With ``parallelism="fsdp"`` no rank holds the whole model, so an epoch's checkpoint and a
commit keep the model and optimizer out of rank 0's file: every rank writes its shard with
``torch.distributed.checkpoint`` (DCP) into ``runs/<run_id>/shards/<name>/`` (the store's
filesystem, through fsspec), and rank 0's file names the folder (``checkpoints.SHARDS``) and is
written after it, so a checkpoint or commit that exists has its shards. This module and
``worker.comm.fsdp`` are imported only by sharded fits (torch's FSDP and DCP take about a
second to import). The optimizer's
state is keyed by parameter name, and DCP re-shards on load: a launch with another number
of processes (an elastic fit started again resized) reads the same folder.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from ...store import Store


def save(store: Store, folder: str, model: torch.nn.Module, optimizer) -> None:
    """Every rank's shard of ``model`` and ``optimizer`` into ``folder`` (a collective)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    url, options = store.fsspec_target(folder)
    dcp.save(
        {"model": model_state, "optimizer": optimizer_state},
        storage_writer=FsspecWriter(url, **options),
    )


def load(store: Store, folder: str, model: torch.nn.Module, optimizer) -> None:
    """Give ``model`` and ``optimizer`` their state from ``folder``, re-sharded over this
    launch's ranks (a collective)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    url, options = store.fsspec_target(folder)
    dcp.load(state, storage_reader=FsspecReader(url, **options))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )


def model_state(store: Store, folder: str, model: torch.nn.Module) -> dict:
    """This rank's shard of the model state in ``folder``, without touching ``model``
    (a collective): e.g. a BestModel's epoch, taken back when a run resumes."""
    state = {k: v.clone() for k, v in get_model_state_dict(model).items()}
    url, options = store.fsspec_target(folder)
    dcp.load({"model": state}, storage_reader=FsspecReader(url, **options))
    return state
