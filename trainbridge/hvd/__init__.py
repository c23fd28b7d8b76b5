"""Horovod's PyTorch API on any launcher: ``import trainbridge.hvd as hvd``.

A drop-in for ``import horovod.torch as hvd`` (0.28.1 names, signatures and
defaults). When horovodrun started the job this module *is* the real
``horovod.torch`` (delegation); under torchrun, mpirun, srun or plain python it
runs the same API on torch.distributed (gloo on CPUs, nccl for CUDA tensors),
with plain python as a job of size 1. :func:`use_real_horovod` makes the choice;
the guide "Migrating from Horovod" (docs/MIGRATING_FROM_HOROVOD.md) has the launch
commands, the behaviour, and every name with its status.

``hvd.using_real_horovod`` tells which one is active.
"""

import sys as _sys

from ..errors import UserError as _UserError
from .delegation import use_real_horovod

try:
    using_real_horovod = use_real_horovod()
    """True when this module is the real ``horovod.torch`` (under horovodrun), False on the torch backend."""
except _UserError as _exc:
    # A script's import, not an entry point: report the bad environment as the CLI does, one line
    # (from the first rank only) and exit status 2, instead of a traceback on every rank.
    from ..launch import detect_launch as _detect_launch

    if _detect_launch().rank == 0:
        print(f"trainbridge: error: {_exc}", file=_sys.stderr, flush=True)
    raise SystemExit(2) from None

if using_real_horovod:
    from ..backends.horovod import HOROVOD_FIX as _FIX, horovod_problem as _horovod_problem

    _problem = _horovod_problem()
    if _problem is not None:  # one line, from the first rank, as above
        from ..launch import detect_launch as _detect_launch

        if _detect_launch().rank == 0:
            print(
                f"trainbridge: error: horovodrun started this job, so trainbridge.hvd is Horovod's own "
                f"horovod.torch, and {_problem}; {_FIX}, or launch with torchrun or mpirun (trainbridge.hvd "
                f"then runs on torch.distributed)",
                file=_sys.stderr,
                flush=True,
            )
        raise SystemExit(2)
    import horovod.torch as _horovod_torch

    globals().update({k: v for k, v in vars(_horovod_torch).items() if not k.startswith("_")})
else:
    from . import elastic
    from .build_info import (
        ccl_built,
        cuda_built,
        ddl_built,
        gloo_built,
        gloo_enabled,
        mpi_built,
        mpi_enabled,
        mpi_threads_supported,
        nccl_built,
        rocm_built,
    )
    from .collectives import (
        allgather,
        allgather_async,
        allreduce,
        allreduce_,
        allreduce_async,
        allreduce_async_,
        alltoall,
        alltoall_async,
        barrier,
        broadcast,
        broadcast_,
        broadcast_async,
        broadcast_async_,
        grouped_allgather,
        grouped_allgather_async,
        grouped_allreduce,
        grouped_allreduce_,
        grouped_allreduce_async,
        grouped_allreduce_async_,
        grouped_reducescatter,
        grouped_reducescatter_async,
        join,
        poll,
        reducescatter,
        reducescatter_async,
        sparse_allreduce_async,
        synchronize,
    )
    from .compression import Compression
    from .errors import HorovodInternalError
    from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
    from .optimizer import DistributedOptimizer
    from .process import (
        cross_rank,
        cross_size,
        init,
        is_homogeneous,
        is_initialized,
        local_rank,
        local_size,
        rank,
        shutdown,
        size,
        start_timeline,
        stop_timeline,
    )
    from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
    from .reduce_ops import Adasum, Average, Max, Min, Product, Sum
    from .sync_batch_norm import SyncBatchNorm
