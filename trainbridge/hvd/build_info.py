"""Build queries, answered for the backend actually in use: torch.distributed (and mpi4py under mpirun).

``*_built`` says what this process can use; ``*_enabled`` what the running
job uses. Collectives always negotiate over gloo, and CUDA tensors go over nccl
when it is available, so MPI is never enabled here, even under mpirun, where
MPI (through mpi4py) only shares the rendezvous address; see "Launching" in
docs/MIGRATING_FROM_HOROVOD.md.
"""

from __future__ import annotations

import importlib.util
import sys

import torch
import torch.distributed as dist

from ..launch import detect_launch
from .process import is_initialized


def mpi_built() -> bool:
    """True when this process can use MPI: torch.distributed's MPI backend, or mpi4py (which the torch
    backend uses under mpirun)."""
    return dist.is_mpi_available() or importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    """Always False: the torch backend runs collectives over gloo and nccl, even under mpirun."""
    return False


def mpi_threads_supported() -> bool:
    """Under mpirun: whether this process's MPI runs with ``MPI_THREAD_MULTIPLE``, so that the script may use
    mpi4py beside trainbridge.hvd (what Horovod's answer is for). Elsewhere, Horovod's ``ValueError``: MPI is
    not in use."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None and detect_launch().launcher == "mpirun" and importlib.util.find_spec("mpi4py") is not None:
        import mpi4py.MPI as mpi  # under mpirun, MPI is this job's to start
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        raise ValueError(
            "Horovod MPI is not enabled: this job was not started by mpirun (or mpi4py is not installed), and the "
            "torch backend runs collectives over gloo/nccl"
        )
    return bool(mpi.Query_thread() == mpi.THREAD_MULTIPLE)


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
