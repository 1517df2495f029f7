"""A decode worker's memory as it reports it: its own (USS) without the shared-memory
segments it writes its batches into, which its rank maps too."""

import os

import torch

from spark_estimator.worker.decode.shared_memory import Segment
from spark_estimator.worker.decode.worker_process import read_memory

MIB = 2**20


def _rollup_private() -> int:
    fields = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f.read().splitlines()[1:]:
            name, value, *_ = line.split()
            fields[name.rstrip(":")] = int(value) * 1024
    return fields["Private_Clean"] + fields["Private_Dirty"]


def test_a_workers_own_memory_leaves_out_the_segments_it_writes_but_not_its_own_buffers():
    before, rollup_before = read_memory(os.getpid()), _rollup_private()
    segment = Segment(32 * MIB)
    segment.view(0, torch.uint8, (32 * MIB,)).fill_(1)  # mapped by this process alone
    after, rollup_after = read_memory(os.getpid()), _rollup_private()
    assert rollup_after - rollup_before >= 30 * MIB  # the kernel counts it as private
    assert after["uss"] - before["uss"] < 8 * MIB
    assert after["rss"] - before["rss"] >= 30 * MIB  # still resident
    own = torch.ones(32 * MIB, dtype=torch.uint8)
    mine = read_memory(os.getpid())
    assert mine["uss"] - after["uss"] >= 30 * MIB
    del own
    segment.close()


def test_a_process_that_is_gone_reads_as_zeros():
    assert read_memory(2**22 + 1) == {"uss": 0, "pss": 0, "rss": 0}
