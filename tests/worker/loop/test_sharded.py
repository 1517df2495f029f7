"""Sharded checkpoints between real processes (spawned, a real gloo group): saved by one
number of ranks, read back by the same or another."""

import gc
import multiprocessing
import os

import torch
import torch.distributed as dist

from spark_estimator.shared.model_factory import materialize
from spark_estimator.store import Store
from spark_estimator.worker.comm.fsdp import shard_model
from spark_estimator.worker.comm.ranks import RankInfo
from spark_estimator.worker.loop import sharded


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.linear(x))


def net() -> torch.nn.Module:
    """Its last layer has one row: with 2 or 3 ranks some hold an empty shard of it."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), Block(), Block(), torch.nn.Linear(16, 1))


def sharded_net(info: RankInfo) -> torch.nn.Module:
    """``net`` built on meta, sharded, then materialized, as a model function is."""
    with torch.device("meta"):
        model = net()
    shard_model(model, info, ("Block",), "none")
    torch.manual_seed(info.rank)
    materialize(model, info.device)
    return model


def _train_save_or_load(rank: int, world: int, folder: str, mode: str) -> None:
    torch.set_num_threads(1)
    pg = dist.FileStore(os.path.join(folder, f"pg-{mode}-{world}"), world)
    dist.init_process_group("gloo", store=pg, rank=rank, world_size=world)
    info = RankInfo(rank, world, rank, world, torch.device("cpu"))
    model = sharded_net(info)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    store = Store(os.path.join(folder, "store"))
    if mode == "save":
        initial = model.state_dict()["3.weight"].full_tensor()  # a collective
        if rank == 0:
            torch.save(initial, f"{folder}/initial.pt")
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(rank))
        for _ in range(2):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():  # as validation does: the root unit stays gathered after it
            model(x)
        sharded.save(store, store.join("shards"), model, optimizer)
        record(folder, f"save-{world}", rank, model, optimizer)
        model = sharded_net(info)  # read back by the same ranks
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    state = sharded.model_state(store, store.join("shards"), sharded_net(info))
    full_state = {k: v.full_tensor() for k, v in state.items()}
    if rank == 0:
        torch.save(full_state, os.path.join(folder, f"model-state-{world}.pt"))
    sharded.load(store, store.join("shards"), model, optimizer)
    record(folder, f"load-{world}", rank, model, optimizer)
    dist.destroy_process_group()


def _run(rank: int, world: int, folder: str, mode: str) -> None:
    """A spawned rank: ``_train_save_or_load``, then its objects' reference cycles (the
    sharded model's, which hold the gloo group) collected while the interpreter lives. Left
    to the process's exit, the group's teardown aborts it ('terminate called without an
    active exception') about one run in two, after every result was written."""
    _train_save_or_load(rank, world, folder, mode)
    gc.collect()


def record(folder: str, name: str, rank: int, model, optimizer) -> None:
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    steps = [s["step"].item() for s in optimizer.state.values()]
    moments = {n: optimizer.state[p]["exp_avg"].full_tensor() for n, p in model.named_parameters()}
    torch.save(
        {"weights": full, "steps": steps, "moments": moments},
        os.path.join(folder, f"{name}-rank-{rank}.pt"),
    )


def spawn(world: int, folder, mode: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    args = [(r, world, str(folder), mode) for r in range(world)]
    procs = [ctx.Process(target=_run, args=a) for a in args]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0


def test_shards_saved_by_two_ranks_load_on_two_and_on_three_with_their_optimizer_state(
    tmp_path,
):
    spawn(2, tmp_path, "save")  # saves, then reads back on the same ranks
    spawn(3, tmp_path, "load")  # re-sharded
    saved = torch.load(tmp_path / "save-2-rank-0.pt")
    loads = [tmp_path / f"load-{w}-rank-{r}.pt" for w in (2, 3) for r in range(w)]
    for got in map(torch.load, loads):
        assert got["weights"].keys() == saved["weights"].keys()
        for name, value in saved["weights"].items():
            assert torch.equal(got["weights"][name], value), name
        for name, value in saved["moments"].items():
            assert torch.equal(got["moments"][name], value), name
        assert got["steps"] == [2.0] * len(saved["weights"])
    for world in (2, 3):  # the model's state alone (a BestModel's epoch)
        state = torch.load(tmp_path / f"model-state-{world}.pt")
        assert all(torch.equal(state[k], v) for k, v in saved["weights"].items())
    # training changed the weights: a load that read nothing would not match
    assert not torch.equal(saved["weights"]["3.weight"], torch.load(tmp_path / "initial.pt"))
