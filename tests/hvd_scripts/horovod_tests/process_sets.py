"""Process sets: Horovod's *_process_sets tests (every collective on the even and the odd ranks' sets,
added with add_process_set and removed after), the queries and errors, and hvd.init(process_sets=...).

The process-set DistributedOptimizer is in uneven_ranks.py: only some ranks reduce there, so it runs last.
"""

import itertools

import numpy as np
import torch

import trainbridge.hvd as hvd

from .common import (
    ALL_TYPES,
    DIMS,
    GRAD_TYPES,
    REAL_HOROVOD_REINIT,
    REDUCE_TYPES,
    EvenOddSets,
    NotApplicable,
    alltoall_input,
    expect_error,
    filled,
    fp32,
    multi_rank_only,
    random_tensor,
    reducescatter_input,
    reducescatter_reference,
)


def test_allreduce_process_sets():
    with EvenOddSets() as sets:
        for dtype, dim in itertools.product(REDUCE_TYPES, DIMS):
            torch.manual_seed(1234)
            even_tensor = random_tensor(dim)
            odd_tensor = random_tensor(dim)
            tensor = (even_tensor if sets.set is sets.even_set else odd_tensor).to(dtype)
            summed = hvd.allreduce(tensor, average=False, process_set=sets.set)
            averaged = hvd.allreduce(tensor, process_set=sets.set)
            tensor, summed, averaged = fp32(tensor, summed, averaged)
            assert torch.allclose(summed, tensor * sets.size, 0), dtype
            if dtype.is_floating_point:
                assert torch.allclose(averaged, tensor, 1e-3), dtype


def test_allreduce_grad_process_sets():
    with EvenOddSets() as sets:
        for dtype, dim in itertools.product(GRAD_TYPES, DIMS):
            tensor = random_tensor(dim, dtype).requires_grad_()
            hvd.allreduce(tensor, average=False, process_set=sets.set).backward(torch.ones([17] * dim, dtype=dtype))
            assert np.linalg.norm(np.ones([17] * dim) * sets.size - tensor.grad.numpy()) < 1e-8


def test_grouped_allreduce_process_sets():
    with EvenOddSets() as sets:
        for dtype, dim in itertools.product(REDUCE_TYPES, DIMS):
            torch.manual_seed(1234)
            tensors = [random_tensor(dim, dtype) for _ in range(5)]
            summed = hvd.grouped_allreduce(tensors, average=False, process_set=sets.set)
            for t, s in zip(tensors, summed):
                t, s = fp32(t, s)
                assert torch.allclose(s, t * sets.size, 0), dtype
        tensors = [torch.ones(3, dtype=torch.float64, requires_grad=True) for _ in range(2)]
        for s in hvd.grouped_allreduce(tensors, average=False, process_set=sets.set):
            s.backward(torch.ones(3, dtype=torch.float64))
        assert all(torch.equal(t.grad, torch.full((3,), float(sets.size), dtype=torch.float64)) for t in tensors)


def test_allgather_process_sets():
    rank = hvd.rank()
    with EvenOddSets() as sets:
        for dtype, dim in itertools.product(ALL_TYPES, DIMS):
            tensor = filled([17] * dim, rank, dtype)
            gathered, = fp32(hvd.allgather(tensor, process_set=sets.set))
            assert list(gathered.shape) == [17 * sets.size] + [17] * (dim - 1)
            for i, member in enumerate(sets.ranks):
                part = gathered[i * 17:(i + 1) * 17]
                assert part.min() == member and part.max() == member, dtype
        # Gradients: the averaged gradient, narrowed to this rank's rows in the set.
        rows = sets.set.rank() + 2
        tensor = torch.ones(rows, 3, dtype=torch.float64, requires_grad=True)
        grad_ys = torch.cat([torch.full((i + 2, 3), float(i), dtype=torch.float64) for i in range(sets.size)])
        hvd.allgather(tensor, process_set=sets.set).backward(grad_ys)
        assert torch.equal(tensor.grad, torch.full((rows, 3), float(sets.set.rank()), dtype=torch.float64))
        rows, ints = hvd.grouped_allgather([torch.full((rank + 1, 2), float(rank)), torch.tensor([rank])],
                                           process_set=sets.set)
        assert ints.tolist() == sets.ranks and rows.shape == (sum(r + 1 for r in sets.ranks), 2)


def test_broadcast_process_sets():
    rank = hvd.rank()
    with EvenOddSets() as sets:
        for dtype, dim, root_rank in itertools.product(ALL_TYPES, DIMS, sets.ranks):
            tensor = filled([17] * dim, rank, dtype)
            root_tensor = filled([17] * dim, root_rank, dtype)
            broadcasted = hvd.broadcast(tensor, root_rank, process_set=sets.set)
            assert torch.equal(*fp32(broadcasted, root_tensor)), (dtype, root_rank)
        for root_rank in sets.ranks:
            tensor = torch.full((4,), float(rank), dtype=torch.float64, requires_grad=True)
            hvd.broadcast(tensor, root_rank, process_set=sets.set).backward(torch.ones(4, dtype=torch.float64))
            assert torch.equal(tensor.grad, torch.full((4,), 1.0 if rank == root_rank else 0.0, dtype=torch.float64))


def test_alltoall_process_sets():
    rank = hvd.rank()
    with EvenOddSets() as sets:
        for dtype, dim in itertools.product(ALL_TYPES, DIMS):
            splits = torch.tensor([rank + 1] * sets.size, dtype=torch.int32)
            collected, received = hvd.alltoall(alltoall_input(dim, dtype, sets.size), splits, process_set=sets.set)
            collected, = fp32(collected)
            assert collected.min() == sets.set.rank() and collected.max() == sets.set.rank(), dtype
            assert received.tolist() == [r + 1 for r in sets.ranks]
        tensor = torch.ones(2 * sets.size, 3, dtype=torch.float64, requires_grad=True)
        hvd.alltoall(tensor, process_set=sets.set).backward(torch.ones(2 * sets.size, 3, dtype=torch.float64))
        assert torch.equal(tensor.grad, torch.ones_like(tensor))


def test_reducescatter_process_sets():
    rank = hvd.rank()
    with EvenOddSets() as sets:
        position = sets.set.rank()
        for dtype, rows in itertools.product([torch.int32, torch.float32, torch.float64],
                                             [sets.size * 3, sets.size * 3 + 1]):
            tensor = reducescatter_input(rows, rank, dtype)
            total, mine = reducescatter_reference(rows, sets.ranks, position, dtype)
            summed = hvd.reducescatter(tensor, op=hvd.Sum, process_set=sets.set)
            assert torch.equal(summed, total[mine]), dtype
            grouped = hvd.grouped_reducescatter([tensor, tensor], op=hvd.Sum, process_set=sets.set)
            assert all(torch.equal(g, summed) for g in grouped)
        tensor = torch.ones(sets.size * 2, 3, dtype=torch.float64, requires_grad=True)
        hvd.reducescatter(tensor, op=hvd.Sum, process_set=sets.set).backward(torch.ones(2, 3, dtype=torch.float64))
        assert torch.equal(tensor.grad, torch.full_like(tensor, float(sets.size)))


def test_broadcast_object_process_sets():
    with EvenOddSets() as sets:
        expected = {"hello": 123, 0: [1, 2]}
        obj = expected if hvd.rank() == sets.ranks[0] else {}
        assert hvd.broadcast_object(obj, root_rank=sets.ranks[0], process_set=sets.set) == expected


def test_process_set_barrier_op():
    with EvenOddSets() as sets:
        for _ in range(3):
            hvd.barrier(process_set=sets.set)
        hvd.barrier()


def test_process_set_queries_and_errors():
    rank, size = hvd.rank(), hvd.size()
    assert hvd.global_process_set.process_set_id == 0 and hvd.global_process_set.ranks == list(range(size))
    assert hvd.global_process_set.size() == size and hvd.global_process_set.rank() == rank
    assert hvd.global_process_set.included() and not hvd.remove_process_set(hvd.global_process_set)
    with EvenOddSets() as sets:
        other = sets.odd_set if sets.set is sets.even_set else sets.even_set
        assert sets.set.included() and not other.included()
        assert sets.set.size() == sets.size and sets.set.rank() == sets.ranks.index(rank)
        assert sets.even_set.process_set_id != sets.odd_set.process_set_id
        expect_error(other.rank, ValueError)  # not a member
        # An operation on a set this rank is not in raises at once (Horovod: ValueError).
        expect_error(lambda: hvd.allreduce(torch.ones(3), name="foreign", process_set=other), ValueError)
        # broadcast's root is a global rank, and must be in the set.
        expect_error(lambda: hvd.broadcast(torch.ones(3), other.ranks[0], name="root_outside", process_set=sets.set),
                     ValueError)
        expect_error(lambda: hvd.add_process_set(sets.ranks), ValueError)  # a duplicate
        hvd.barrier()
    # After removal: id None, queries None, operations rejected (Horovod raises TypeError there).
    assert sets.set.process_set_id is None and sets.set.size() is None and sets.set.rank() is None
    expect_error(lambda: hvd.allreduce(torch.ones(3), name="removed", process_set=sets.set), TypeError, ValueError)
    expect_error(lambda: hvd.allreduce(torch.ones(3), name="never_added", process_set=hvd.ProcessSet([0])),
                 TypeError, ValueError)
    assert hvd.allreduce(torch.ones(3), op=hvd.Sum, name="after_process_set_errors").tolist() == [size] * 3


def test_static_process_sets():
    """hvd.init(process_sets=[...]): Horovod's test_process_sets_static (duplicates fail init on every rank)."""
    multi_rank_only()
    if hvd.using_real_horovod:
        # Horovod's own test runs in a fresh process (2 of 6 tries of init/allreduce/shutdown/init hung here).
        raise NotApplicable(REAL_HOROVOD_REINIT)
    rank, size = hvd.rank(), hvd.size()
    hvd.shutdown()
    middle = range(size - 1, 0, -1) if rank else range(1, size)  # the order inside a set does not matter
    try:
        hvd.init(process_sets=[hvd.ProcessSet([0]), hvd.ProcessSet(middle), hvd.ProcessSet(range(size - 1, -1, -1)),
                               hvd.ProcessSet([0])])
        raise AssertionError("duplicate process sets did not fail hvd.init()")
    except ValueError:
        pass
    first, rest = hvd.ProcessSet([0]), hvd.ProcessSet(middle)
    hvd.init(process_sets=[first, rest])
    try:
        assert hvd.global_process_set.process_set_id == 0 and hvd.global_process_set.ranks == list(range(size))
        assert (first.process_set_id, first.ranks) == (1, [0]), first
        assert (rest.process_set_id, rest.ranks) == (2, list(range(1, size))), rest
        this = first if rank == 0 else rest
        summed = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum, name="static", process_set=this)
        assert summed.item() == sum(this.ranks), summed
        hvd.barrier()
    finally:
        hvd.shutdown()
        hvd.init()
