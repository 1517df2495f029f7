"""Adasum between real processes (spawned, joined by a real gloo group over a FileStore),
against a numpy reference of the same tree."""

import multiprocessing
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from spark_estimator.worker.comm.adasum import adasum_allreduce_

SHAPES = [((3, 4), torch.float32), ((7,), torch.float64), ((2, 3, 5), torch.float16)]


def cases(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    """Per rank, named lists of tensors: orthogonal, identical, and random of several
    shapes and dtypes (rank 0's first one zero; one tensor a non-contiguous view)."""
    g = torch.Generator().manual_seed(100 + rank)
    orthogonal = torch.zeros(world + 1)
    orthogonal[rank] = rank + 1.5
    same = torch.linspace(-1, 2, 11, dtype=torch.float64)
    mixed = [torch.randn(shape, generator=g).to(dtype) for shape, dtype in SHAPES]
    if rank == 0:
        mixed[0].zero_()
    mixed.append(torch.randn(5, 3, generator=g).t())  # a view that is not contiguous
    return {"orthogonal": [orthogonal], "identical": [same], "mixed": mixed}


def reference_adasum(per_rank: list[np.ndarray]) -> np.ndarray:
    """The Adasum tree of the module docstring, in numpy."""
    dtype = per_rank[0].dtype

    def combine(a, b):
        a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
        dot, a_sq, b_sq = a64 @ b64, a64 @ a64, b64 @ b64
        a_coef = 1 - dot / (2 * a_sq) if a_sq > 0 else 1.0
        b_coef = 1 - dot / (2 * b_sq) if b_sq > 0 else 1.0
        return (a_coef * a64 + b_coef * b64).astype(dtype).reshape(a.shape)

    values = list(per_rank)
    power = 1 << (len(values).bit_length() - 1)
    for extra in range(power, len(values)):
        values[extra - power] = combine(values[extra - power], values[extra])
    level = 1
    while level < power:
        pairs = [sorted((r, r ^ level)) for r in range(power)]
        values = [combine(values[low], values[high]) for low, high in pairs]
        level <<= 1
    return values[0]


def _reduce_on_gloo(rank: int, world: int, folder: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(folder, "pg-store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    results = {}
    for name, tensors in cases(rank, world).items():
        adasum_allreduce_(tensors)
        results[name] = tensors
    if world == 4:  # a subgroup whose group ranks are not the global ranks
        subgroup = dist.new_group([1, 3])
        if rank in (1, 3):
            tensors = cases(rank, world)["mixed"]
            adasum_allreduce_(tensors, group=subgroup)
            results["subgroup"] = tensors
    torch.save(results, os.path.join(folder, f"rank-{rank}.pt"))
    dist.destroy_process_group()


def spawn_ranks(target, world: int, folder) -> list[dict]:
    """Run ``target(rank, world, folder)`` in ``world`` spawned processes; what each saved."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, str(folder))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    return [torch.load(folder / f"rank-{r}.pt") for r in range(world)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_gets_the_reference_adasum(tmp_path, world):
    ranks = spawn_ranks(_reduce_on_gloo, world, tmp_path)
    inputs = [cases(r, world) for r in range(world)]
    for name in ["orthogonal", "identical", "mixed"]:
        for i, got in enumerate(ranks[0][name]):
            want = reference_adasum([inputs[r][name][i].numpy() for r in range(world)])
            assert got.dtype == inputs[0][name][i].dtype and got.shape == want.shape
            tol = 1e-3 if got.dtype == torch.float16 else 1e-6
            np.testing.assert_allclose(got.numpy().astype(np.float64), want, rtol=tol, atol=tol)
            for other in ranks[1:]:
                assert torch.equal(other[name][i], got)  # bitwise: the replicas never drift
    orthogonal = sum(inputs[r]["orthogonal"][0] for r in range(world))
    assert torch.equal(ranks[0]["orthogonal"][0], orthogonal)  # orthogonal gradients add
    assert torch.equal(ranks[0]["identical"][0], inputs[0]["identical"][0])  # stay the same
    assert not torch.allclose(ranks[0]["mixed"][1], sum(i["mixed"][1] for i in inputs) / world)
    if world == 4:
        for i, got in enumerate(ranks[1]["subgroup"]):
            want = reference_adasum([inputs[r]["mixed"][i].numpy() for r in (1, 3)])
            tol = 1e-3 if got.dtype == torch.float16 else 1e-6
            np.testing.assert_allclose(got.numpy().astype(np.float64), want, rtol=tol, atol=tol)
            assert torch.equal(ranks[3]["subgroup"][i], got)
        assert "subgroup" not in ranks[0]
