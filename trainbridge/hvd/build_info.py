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
    """True when this torch build has torch.distributed's MPI backend."""
    return dist.is_mpi_available()


def mpi_enabled() -> bool:
    """Always False: the torch backend runs collectives over gloo and nccl, even under mpirun."""
    return False


def mpi_threads_supported() -> bool:
    """Raises ``ValueError`` as Horovod does when MPI is not enabled (never on the torch backend)."""
    raise ValueError("Horovod MPI is not enabled; the torch backend runs collectives over gloo/nccl")


def gloo_built() -> bool:
    """True when this torch build has gloo."""
    return dist.is_gloo_available()


def gloo_enabled() -> bool:
    """True once :func:`init` has run (collectives negotiate over gloo)."""
    return is_initialized() and dist.is_gloo_available()


def nccl_built() -> int:
    """Horovod's convention: NCCL_VERSION_CODE (e.g. 22105 for 2.21.5) when built with NCCL, else 0."""
    if not (dist.is_nccl_available() and torch.backends.cuda.is_built()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()
    return major * 10000 + minor * 100 + patch


def cuda_built() -> bool:
    """True when this torch build has CUDA."""
    return torch.backends.cuda.is_built() and torch.version.cuda is not None


def rocm_built() -> bool:
    """True when this torch build has ROCm (HIP)."""
    return torch.version.hip is not None


def ddl_built() -> bool:
    """Always False: IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """Always False: oneCCL is not supported."""
    return False
