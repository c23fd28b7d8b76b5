"""Build queries, answered for the backend actually in use: torch.distributed.

``*_built`` says what this torch build can do; ``*_enabled`` what the running
job uses. Collectives always negotiate over gloo, and CUDA tensors go over nccl
when it is available, so MPI is never enabled here, even under mpirun (which
only starts the processes; see "Launching" in docs/MIGRATING_FROM_HOROVOD.md).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .process import is_initialized


def mpi_built() -> bool:
    return dist.is_mpi_available()


def mpi_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    raise ValueError("Horovod MPI is not enabled; the torch backend runs collectives over gloo/nccl")


def gloo_built() -> bool:
    return dist.is_gloo_available()


def gloo_enabled() -> bool:
    return is_initialized() and dist.is_gloo_available()


def nccl_built() -> int:
    """Horovod's convention: NCCL_VERSION_CODE (e.g. 22105 for 2.21.5) when built with NCCL, else 0."""
    if not (dist.is_nccl_available() and torch.backends.cuda.is_built()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()
    return major * 10000 + minor * 100 + patch


def cuda_built() -> bool:
    return torch.backends.cuda.is_built() and torch.version.cuda is not None


def rocm_built() -> bool:
    return torch.version.hip is not None


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False
