"""allgather (variable sizes, async, gradients, errors), grouped_allgather, allgather_object and
broadcast_object, broadcast (in place, gradients, errors)."""

import itertools

import numpy as np
import torch

import trainbridge.hvd as hvd

from .common import (
    ALL_TYPES,
    DIMS,
    GRAD_TYPES,
    dtype_differs_by_rank,
    expect_duplicate_name_error,
    expect_error,
    filled,
    fp32,
    multi_rank_only,
)


# ----- allgather -------------------------------------------------------------------
def test_allgather():
    rank, size = hvd.rank(), hvd.size()
    for dtype, dim in itertools.product(ALL_TYPES, DIMS):
        tensor = filled([17] * dim, rank, dtype)
        gathered, = fp32(hvd.allgather(tensor))
        assert list(gathered.shape) == [17 * size] + [17] * (dim - 1)
        for i in range(size):
            rank_tensor = gathered[i * 17:(i + 1) * 17]
            assert list(rank_tensor.shape) == [17] * dim
            assert rank_tensor.min() == i and rank_tensor.max() == i, dtype


def test_allgather_variable_size():
    rank, size = hvd.rank(), hvd.size()
    for dtype, dim in itertools.product(ALL_TYPES, DIMS):
        tensor_sizes = ([17, 32, 81, 12, 15, 23, 22] * 5)[:size]
        tensor = filled([tensor_sizes[rank]] + [17] * (dim - 1), rank, dtype)
        gathered, = fp32(hvd.allgather(tensor))
        assert list(gathered.shape) == [sum(tensor_sizes)] + [17] * (dim - 1)
        for i in range(size):
            rank_tensor = gathered[sum(tensor_sizes[:i]):sum(tensor_sizes[:i + 1])]
            assert list(rank_tensor.shape) == [tensor_sizes[i]] + [17] * (dim - 1)
            assert rank_tensor.min() == i and rank_tensor.max() == i


def test_allgather_async_fused():
    rank, size = hvd.rank(), hvd.size()
    tests, poll_false_once = [], False
    for dtype, dim in itertools.product(ALL_TYPES, DIMS):
        tensor = filled([17] * dim, rank, dtype)
        handle = hvd.allgather_async(tensor)
        poll_false_once = poll_false_once or not hvd.poll(handle)
        tests.append((handle, [17] * dim))
    assert poll_false_once or size == 1, "hvd.poll() always returns True, not an async op?"
    for handle, rank_shape in tests:
        gathered, = fp32(hvd.synchronize(handle))
        for i in range(size):
            rank_tensor = gathered[i * 17:(i + 1) * 17]
            assert list(rank_tensor.shape) == rank_shape
            assert rank_tensor.min() == i and rank_tensor.max() == i


def test_allgather_error():
    multi_rank_only()
    tensor_size = [17] * 3
    tensor_size[1] = 10 * (hvd.rank() + 1)
    expect_error(lambda: hvd.allgather(torch.FloatTensor(*tensor_size).fill_(1)), RuntimeError)


def test_allgather_type_error():
    multi_rank_only()
    expect_error(lambda: hvd.allgather(dtype_differs_by_rank()), RuntimeError)


def test_allgather_duplicate_name_error():
    multi_rank_only()
    expect_duplicate_name_error(lambda name: hvd.allgather_async(torch.FloatTensor(*[17] * 3), name=name))


def test_allgather_grad():
    rank, size = hvd.rank(), hvd.size()
    for dtype, dim in itertools.product(GRAD_TYPES, DIMS):
        tensor_sizes = ([3, 2, 7, 4, 6, 8, 10] * 5)[:size]
        tensor = filled([tensor_sizes[rank]] + [17] * (dim - 1), rank, dtype)
        tensor.requires_grad_()
        grad_ys = torch.cat([torch.ones([n] + [17] * (dim - 1), dtype=dtype) * r for r, n in enumerate(tensor_sizes)])
        hvd.allgather(tensor).backward(grad_ys)
        # horovod.torch 0.28.1 averages the incoming gradient (its master test expects rank * size).
        expected = np.ones([tensor_sizes[rank]] + [17] * (dim - 1)) * rank
        assert np.linalg.norm(expected - tensor.grad.numpy()) < 1e-8, (tensor.grad.flatten()[:3], rank)


def test_grouped_allgather():
    rank, size = hvd.rank(), hvd.size()
    tensors = [torch.full((rank + 1, 3), float(rank)), torch.full((2,), rank, dtype=torch.int64)]
    rows, ints = hvd.grouped_allgather(tensors)
    assert rows.shape == (size * (size + 1) // 2, 3)
    assert ints.tolist() == [r for r in range(size) for _ in range(2)]


def test_allgather_object():
    d = {"metric_val_1": hvd.rank()}
    if hvd.rank() == 1:
        d["metric_val_2"] = 42
    results = hvd.allgather_object(d)
    expected = [{"metric_val_1": i} for i in range(hvd.size())]
    if hvd.size() > 1:
        expected[1] = {"metric_val_1": 1, "metric_val_2": 42}
    assert results == expected, results


def test_broadcast_object():
    expected_obj = {"hello": 123, 0: [1, 2]}
    obj = expected_obj if hvd.rank() == 0 else {}
    assert hvd.broadcast_object(obj, root_rank=0) == expected_obj


# ----- broadcast -------------------------------------------------------------------
def _broadcast_inputs():
    """For every dtype, dimension and root rank: the root, this rank's tensor and the root's (Horovod's inputs)."""
    rank, size = hvd.rank(), hvd.size()
    for dtype, dim, root_rank in itertools.product(ALL_TYPES, DIMS, range(size)):
        yield root_rank, filled([17] * dim, rank, dtype), filled([17] * dim, root_rank, dtype)


def test_broadcast():
    multi_rank_only()
    rank = hvd.rank()
    for root_rank, tensor, root_tensor in _broadcast_inputs():
        broadcasted = hvd.broadcast(tensor, root_rank)
        tensor, root_tensor, broadcasted = fp32(tensor, root_tensor, broadcasted)
        if rank != root_rank:
            assert (tensor == root_tensor).max() == 0, "hvd.broadcast modifies source tensor"
        assert (broadcasted == root_tensor).min() == 1, "hvd.broadcast produces incorrect broadcasted tensor"


def test_broadcast_inplace():
    multi_rank_only()
    for root_rank, tensor, root_tensor in _broadcast_inputs():
        broadcasted = hvd.broadcast_(tensor, root_rank)
        tensor, root_tensor, broadcasted = fp32(tensor, root_tensor, broadcasted)
        assert (tensor == broadcasted).min() == 1, "hvd.broadcast does not modify source tensor"
        assert (broadcasted == root_tensor).min() == 1


def test_broadcast_error():
    multi_rank_only()
    tensor_size = [17] * 3
    tensor_size[1] = 10 * (hvd.rank() + 1)
    expect_error(lambda: hvd.broadcast(torch.FloatTensor(*tensor_size).fill_(1), 0), RuntimeError)


def test_broadcast_type_error():
    multi_rank_only()
    expect_error(lambda: hvd.broadcast(dtype_differs_by_rank(), 0), RuntimeError)


def test_broadcast_rank_error():
    multi_rank_only()
    expect_error(lambda: hvd.broadcast(torch.FloatTensor(*[17] * 3).fill_(1), hvd.rank()), RuntimeError)


def test_broadcast_duplicate_name_error():
    multi_rank_only()
    expect_duplicate_name_error(lambda name: hvd.broadcast_async(torch.FloatTensor(*[17] * 3), 0, name=name))


def test_broadcast_grad():
    multi_rank_only()
    rank, size = hvd.rank(), hvd.size()
    for dtype, dim, root_rank in itertools.product(GRAD_TYPES, DIMS, range(size)):
        tensor = filled([17] * dim, rank, dtype).requires_grad_()
        hvd.broadcast(tensor, root_rank).backward(torch.ones([17] * dim, dtype=dtype))
        # horovod.torch 0.28.1 averages the incoming gradient (its master test expects size on the root).
        expected = np.ones([17] * dim) * (1 if rank == root_rank else 0)
        assert np.linalg.norm(expected - tensor.grad.numpy()) < 1e-8
