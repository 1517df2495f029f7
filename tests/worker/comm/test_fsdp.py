"""FSDP's pieces in a real one-process gloo group (sharding over 2+ ranks: tests/test_fsdp.py)."""

import pytest
import torch

from spark_estimator.worker.comm import fsdp
from spark_estimator.worker.comm.ranks import RankInfo

ONE = RankInfo(0, 1, 0, 1, torch.device("cpu"))


def test_the_fitted_weights_are_gathered_when_they_fit_and_refused_when_they_do_not(
    process_group, monkeypatch
):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    want = {k: v.clone() for k, v in net.state_dict().items()}
    fsdp.shard_model(net, ONE, ("Linear",), "none")
    assert fsdp.local_elements(net) == 4 * 8 + 8 + 8 + 1
    got = fsdp.full_state_dict(net)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    monkeypatch.setattr(fsdp, "available_bytes", lambda: 100)
    with pytest.raises(MemoryError, match="fitted model's weights .* do not fit rank 0's"):
        fsdp.full_state_dict(net)


def test_a_unit_class_the_model_lacks_is_named(process_group):
    with pytest.raises(
        ValueError, match=r"fsdp_wrap: the model has no submodule of class \['Block'\]"
    ):
        fsdp.shard_model(torch.nn.Linear(2, 2), ONE, ("Block",), "none")


def test_mixed_precision_computes_in_bf16_and_returns_float32(process_group):
    net = fsdp.shard_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), ONE, (), "bf16")
    assert net(torch.ones(3, 2)).dtype == torch.float32
    assert fsdp.policy("bf16", root=False).param_dtype == torch.bfloat16
    assert fsdp.policy("bf16", root=False).reduce_dtype == torch.float32


MAPPED_BLOCKS = """
import ctypes, sys, torch
from spark_estimator.worker.comm import fsdp

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2

def mapped_by(nbytes):
    # how many mappings of their own one block of nbytes got, while it is held
    before = libc.mallinfo2().hblks
    block = torch.empty(nbytes, dtype=torch.uint8)
    return libc.mallinfo2().hblks - before

big = torch.empty(16 << 20, dtype=torch.uint8)
del big  # a mapped block freed: glibc's threshold rises to 16 MiB
if sys.argv[1] == "shard":  # a CPU rank's model sharded (a one-process group)
    from spark_estimator.worker.comm.ranks import RankInfo
    torch.distributed.init_process_group(
        "gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
    fsdp.shard_model(torch.nn.Linear(2, 2), RankInfo(0, 1, 0, 1, torch.device("cpu")), (), "none")
print(mapped_by(2 << 20), mapped_by(512 << 10))
"""


def test_cpu_ranks_have_glibc_map_freed_blocks_of_1_mib_or_more_on_their_own(tmp_path):
    # what FSDP frees after each unit (its gathered parameters) goes back to the system
    # instead of spreading glibc's heap: the 4-rank memory of benchmarks/fsdp_memory.py
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's malloc only")
    script = tmp_path / "mapped.py"
    script.write_text(MAPPED_BLOCKS)

    def mapped(mode: str) -> list[str]:
        argv = [sys.executable, str(script), mode, str(tmp_path / f"{mode}.group")]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    # 2 MiB blocks: in the heap under glibc's risen threshold, mapped once a CPU rank's
    # model is sharded; 512 KiB blocks stay in the heap
    assert mapped("plain") == ["0", "0"]
    assert mapped("shard") == ["1", "0"]
