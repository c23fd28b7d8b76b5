"""barrier: repeated, waiting for the slowest rank, and among pending collectives."""

import time

import torch

import trainbridge.hvd as hvd

from .common import multi_rank_only


def test_barrier():
    for _ in range(3):
        hvd.barrier()


def test_global_barrier_op():
    """Horovod's test, with 1 s instead of 5: a barrier waits for the slowest rank."""
    multi_rank_only()
    started = time.monotonic()
    if hvd.rank() == 0:
        time.sleep(1)
    hvd.barrier()
    assert time.monotonic() - started >= 1


def test_barrier_with_multiple_collectives():
    bcast_handle = hvd.broadcast_async(torch.eye(3), root_rank=0)
    allgather_handles = [hvd.allgather_async(torch.eye(5)), hvd.allgather_async(torch.zeros([5, 5]))]
    allreduce_handle = hvd.allreduce_async(torch.eye(5))
    hvd.barrier()
    assert torch.equal(hvd.synchronize(allreduce_handle), torch.eye(5))
    assert torch.equal(hvd.synchronize(bcast_handle), torch.eye(3))
    assert [hvd.synchronize(h).shape[0] for h in allgather_handles] == [5 * hvd.size()] * 2
