"""Last: checks in which ranks issue different operations (the process-set optimizer, join).

They would shift the auto-generated names of every later unnamed operation, in the real Horovod
as here: the real Horovod numbers unnamed operations by a per-process handle count that every
operation advances, named or not. horovod_suite.py runs this module after all the others.
"""

import itertools

import torch
import torch.nn.functional as F

import trainbridge.hvd as hvd

from .common import (
    DIMS,
    INT_TYPES,
    EvenOddSets,
    distributed_sgd,
    expect_error,
    multi_rank_only,
    random_tensor,
    regression_batch,
    regression_model,
    threshold,
)


def test_optimizer_process_sets():
    """DistributedOptimizer on the even set: even ranks end equal, odd ranks step on their own gradients
    (only the even ranks reduce gradients)."""
    with EvenOddSets() as sets:
        torch.manual_seed(hvd.rank())
        x, y = regression_batch()
        model = regression_model()
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
                                             named_parameters=model.named_parameters(), process_set=sets.even_set)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer.zero_grad()
        F.mse_loss(model(x), y, reduction="sum").backward()
        optimizer.step()
        v = model.state_dict()["2.weight"]
        all_v = hvd.allgather(v, process_set=sets.set).view(sets.size, *v.shape)
        if sets.set is sets.even_set:
            assert all(torch.allclose(v, other) for other in all_v)
        else:
            assert all(not torch.allclose(v, other) for i, other in enumerate(all_v) if i != sets.set.rank())


def test_join_allreduce():
    rank, size = hvd.rank(), hvd.size()
    for dtype, dim, first_join_rank, caching in itertools.product(
            [torch.int32, torch.int64, torch.float32, torch.float64], DIMS, [0, 1], [False, True]):
        torch.manual_seed(1234)

        def div(t, s, dtype=dtype):
            # 0.28.1 truncates integer averages (its test's floor_divide truncated in torch < 1.13), and
            # averages floats by multiplying with 1/size in the tensor's dtype (ScaleBuffer): with 3 ranks
            # that differs from t / 3 in the last bit, with 2 it does not.
            if dtype in INT_TYPES:
                return torch.div(t, s, rounding_mode="trunc")
            return t * torch.tensor(1.0 / s, dtype=dtype)

        tensor_a = random_tensor(dim, dtype, side=5)
        tensor_b = random_tensor(dim, dtype)
        if caching:
            hvd.synchronize(hvd.allreduce_async(tensor_a, name="tensor_a", average=True))
            hvd.synchronize(hvd.allreduce_async(tensor_b, name="tensor_b", average=True))
        if rank == first_join_rank % size:
            ret = hvd.join()
        else:
            averaged_a = hvd.synchronize(hvd.allreduce_async(tensor_a, name="tensor_a", average=True))
            averaged_b = hvd.synchronize(hvd.allreduce_async(tensor_b, name="tensor_b", average=True))
            ret = hvd.join()
            assert torch.allclose(averaged_a, div(tensor_a * (size - 1), size), threshold(dtype)), dtype
            assert torch.allclose(averaged_b, div(tensor_b * (size - 1), size), threshold(dtype)), dtype
        assert hvd.allgather_object(ret) == [ret] * size, "join must return the same rank everywhere"


def test_join_returns_last_rank():
    multi_rank_only()
    # Rank size-1 keeps working (two allreduces answered by the joined ranks) and joins last.
    if hvd.rank() == hvd.size() - 1:
        for step in range(2):
            assert hvd.allreduce(torch.ones(3), op=hvd.Sum, name=f"after_join.{step}").tolist() == [1.0] * 3
    assert hvd.join() == hvd.size() - 1


def test_join_allgather():
    multi_rank_only()
    if hvd.rank() == 0:
        hvd.join()
    else:
        expect_error(lambda: hvd.allgather(torch.FloatTensor(*[17] * 3), name="join_allgather"), RuntimeError)
        hvd.join()


def test_join_broadcast():
    multi_rank_only()
    if hvd.rank() == 0:
        hvd.join()
    else:
        expect_error(lambda: hvd.broadcast(torch.FloatTensor(*[17] * 3), 1, name="join_broadcast"), RuntimeError)
        hvd.join()


def test_join_uneven_batches_with_optimizer():
    multi_rank_only()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = distributed_sgd(model)
    for _ in range(3 + 2 * hvd.rank()):  # uneven batch counts: 3, 5, 7, ...
        optimizer.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
    last = hvd.join()
    assert last == hvd.size() - 1, last
    assert hvd.allgather_object(last) == [last] * hvd.size()
