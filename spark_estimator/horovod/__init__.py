"""Horovod's PyTorch API on spark-estimator's process group: a Horovod script runs after
changing ``import horovod.torch as hvd`` to ``import spark_estimator.horovod as hvd``.

    import spark_estimator.horovod as hvd
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    loss = hvd.allreduce(loss, name="loss")

The ranks are those of the running task (``run(fn)`` or the launcher): rank, size and
device come from the process group the task formed, over gloo (CPU) or NCCL (GPU).
docs/horovod.md lists every name and how it differs from Horovod's.
"""

from . import elastic
from .async_ops import (
    allgather_async,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    poll,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from .basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)
from .collectives import (
    allgather,
    allgather_object,
    allreduce,
    allreduce_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_object,
    grouped_allreduce,
    join,
)
from .compression import Compression, Compressor
from .core import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .errors import HorovodInternalError
from .functions import broadcast_optimizer_state, broadcast_parameters
from .launch import run
from .optimizer import DistributedOptimizer
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .sync_batch_norm import SyncBatchNorm
from .timeline import start_timeline, stop_timeline

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "is_homogeneous",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "nccl_built",
    "gloo_built",
    "mpi_built",
    "cuda_built",
    "rocm_built",
    "ddl_built",
    "ccl_built",
    "mpi_enabled",
    "gloo_enabled",
    "mpi_threads_supported",
    "ReduceOp",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "allreduce",
    "allreduce_",
    "grouped_allreduce",
    "allgather",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "allgather_object",
    "barrier",
    "join",
    "ProcessSet",
    "add_process_set",
    "remove_process_set",
    "global_process_set",
    "Compression",
    "Compressor",
    "DistributedOptimizer",
    "allgather_async",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "broadcast_async",
    "broadcast_async_",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "poll",
    "reducescatter",
    "reducescatter_async",
    "sparse_allreduce_async",
    "synchronize",
    "SyncBatchNorm",
    "run",
    "start_timeline",
    "stop_timeline",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "elastic",
    "HorovodInternalError",
]
