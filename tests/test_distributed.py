"""The Horovod-style helpers outside a task: a clear RuntimeError, no torch.distributed error."""

import pytest
import torch

from spark_estimator import distributed as sd

CALLS = {
    "rank": lambda: sd.rank(),
    "size": lambda: sd.size(),
    "local_rank": lambda: sd.local_rank(),
    "local_size": lambda: sd.local_size(),
    "device": lambda: sd.device(),
    "allreduce number": lambda: sd.allreduce(1.0),
    "allreduce tensor": lambda: sd.allreduce(torch.ones(2), average=False),
    "broadcast_object": lambda: sd.broadcast_object({"a": 1}),
    "barrier": lambda: sd.barrier(),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_helpers_outside_a_task_raise_a_clear_error(name):
    with pytest.raises(RuntimeError, match="not inside a spark-estimator task"):
        CALLS[name]()
