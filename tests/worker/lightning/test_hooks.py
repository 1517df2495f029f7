"""The Lightning plug-ins on their own: package detection, checkpoint IO, environment."""

from __future__ import annotations

import posixpath

import fsspec
import pytest
import torch

from spark_estimator.shared.packages import lightning_package
from spark_estimator.store import Store
from spark_estimator.worker.lightning.hooks import fsspec_defaults, lightning_parts

pl = pytest.importorskip("lightning.pytorch")


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)


def test_the_package_is_the_one_the_module_subclasses():
    legacy = pytest.importorskip("pytorch_lightning")

    class Legacy(legacy.LightningModule):
        pass

    assert lightning_package(Tiny()) is pl
    assert lightning_package(Legacy()) is legacy
    assert lightning_package(torch.nn.Linear(2, 1)) is None
    environment, checkpoint_io, recorder, gradients, results = lightning_parts(legacy)
    assert issubclass(environment, legacy.plugins.ClusterEnvironment)
    assert issubclass(recorder, legacy.callbacks.Checkpoint)
    assert issubclass(gradients, legacy.Callback)


def test_every_task_is_a_node_of_one_device_with_its_own_rank():
    environment = lightning_parts(pl)[0](rank=3, world_size=4)
    assert environment.creates_processes_externally
    assert (environment.global_rank(), environment.world_size()) == (3, 4)
    assert (environment.node_rank(), environment.local_rank()) == (3, 0)


def test_checkpoints_go_through_the_store_atomically_and_elsewhere_by_their_url(tmp_path):
    store = Store.create(str(tmp_path / "store"))
    io = lightning_parts(pl)[1](store)
    state = {"state_dict": {"w": torch.arange(3.0)}, "epoch": 2, "loops": {"a": [1, 2]}}
    inside = posixpath.join(store.run("r").lightning, "x.ckpt")
    outside = str(tmp_path / "elsewhere" / "y.ckpt")
    for path in (inside, outside):
        io.save_checkpoint(state, path)
        loaded = io.load_checkpoint(path)
        assert torch.equal(loaded["state_dict"]["w"], state["state_dict"]["w"])
        assert loaded["loops"] == state["loops"]
        io.remove_checkpoint(path)
        assert not store.fs.exists(path)
    assert store.fs.ls(store.run("r").lightning) == []  # no temporary file left behind


def test_a_remote_stores_options_are_fsspecs_defaults_only_while_training():
    store = Store("memory://bucket", storage_options={"skip_instance_cache": True})
    assert "memory" not in fsspec.config.conf
    with fsspec_defaults(store):
        assert fsspec.config.conf["memory"] == {"skip_instance_cache": True}
    assert "memory" not in fsspec.config.conf
