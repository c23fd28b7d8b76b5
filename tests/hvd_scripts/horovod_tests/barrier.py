"""barrier: repeated, waiting for the slowest rank, and among pending collectives."""

import time

import torch

import trainbridge.hvd as hvd

from .common import multi_rank_only


def test_barrier():
    for _ in range(3):
        hvd.barrier()


def test_global_barrier_op():
    """Horovod's test, with 1 s instead of 5: a barrier waits for the slowest rank.

    No rank may leave the barrier before rank 0, 1 s late, reached it. Timed on the wall clock the
    ranks share (the suite runs on one host), not from each rank's own start: a rank that came to
    this check later than rank 0 (its previous check ended later) rightly waits less than 1 s."""
    multi_rank_only()
    hvd.barrier()
    if hvd.rank() == 0:
        time.sleep(1)
    reached = time.time()
    hvd.barrier()
    left = time.time()
    arrivals = hvd.allgather_object(reached)
    assert left >= max(arrivals), (left, arrivals)  # a barrier that did not wait: 1 s early on every other rank


def test_barrier_with_multiple_collectives():
    bcast_handle = hvd.broadcast_async(torch.eye(3), root_rank=0)
    allgather_handles = [hvd.allgather_async(torch.eye(5)), hvd.allgather_async(torch.zeros([5, 5]))]
    allreduce_handle = hvd.allreduce_async(torch.eye(5))
    hvd.barrier()
    assert torch.equal(hvd.synchronize(allreduce_handle), torch.eye(5))
    assert torch.equal(hvd.synchronize(bcast_handle), torch.eye(3))
    assert [hvd.synchronize(h).shape[0] for h in allgather_handles] == [5 * hvd.size()] * 2
