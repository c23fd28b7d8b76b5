"""init, shutdown and re-init, rank and size, the local and cross layout, the build queries."""

import importlib.util
import os

import torch

import trainbridge.hvd as hvd

from .common import REAL_HOROVOD_REINIT, NotApplicable, expect_error


def test_rank_and_size():
    launched = {"RANK": "WORLD_SIZE", "HOROVOD_RANK": "HOROVOD_SIZE", "OMPI_COMM_WORLD_RANK": "OMPI_COMM_WORLD_SIZE"}
    for rank_var, size_var in launched.items():
        if rank_var in os.environ:
            assert hvd.rank() == int(os.environ[rank_var]), (hvd.rank(), os.environ[rank_var])
            assert hvd.size() == int(os.environ[size_var]), (hvd.size(), os.environ[size_var])
            return
    assert (hvd.rank(), hvd.size()) == (0, 1)


def test_local_and_cross_layout():
    # Single node: everybody is local; one process per local rank across nodes.
    assert hvd.local_size() == hvd.size() and hvd.local_rank() == hvd.rank()
    assert hvd.cross_size() == 1 and hvd.cross_rank() == 0


def test_is_initialized_and_reinit():
    assert hvd.is_initialized()
    if hvd.mpi_enabled():
        raise NotApplicable("Horovod cannot be re-initialized under MPI")
    if hvd.using_real_horovod:
        raise NotApplicable(REAL_HOROVOD_REINIT)
    rank, size = hvd.rank(), hvd.size()
    hvd.shutdown()
    assert not hvd.is_initialized()
    hvd.init()
    assert (hvd.rank(), hvd.size()) == (rank, size)
    assert hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist() == [size] * 3


def test_build_queries():
    assert isinstance(hvd.nccl_built(), int) and isinstance(hvd.cuda_built(), bool)
    assert hvd.gloo_enabled() or hvd.mpi_enabled()
    if not hvd.using_real_horovod:
        import torch.distributed as dist
        assert hvd.gloo_enabled() and not hvd.mpi_enabled()
        mpi4py = importlib.util.find_spec("mpi4py") is not None
        assert hvd.mpi_built() == (dist.is_mpi_available() or mpi4py) and hvd.gloo_built() == dist.is_gloo_available()
        if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ:  # mpirun: MPI is there to ask
            from mpi4py import MPI
            assert hvd.mpi_threads_supported() == (MPI.Query_thread() == MPI.THREAD_MULTIPLE)
        else:
            expect_error(hvd.mpi_threads_supported, ValueError)
        assert hvd.cuda_built() == (torch.version.cuda is not None)
