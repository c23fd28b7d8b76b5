"""alltoall (splits, gradients, errors) and reducescatter (Sum and Average, async, scaled, gradients, errors):
the collectives that give each rank its own part."""

import itertools

import numpy as np
import torch

import trainbridge.hvd as hvd

from .common import (
    ALL_TYPES,
    DIMS,
    GRAD_TYPES,
    REDUCE_TYPES,
    alltoall_input,
    dtype_differs_by_rank,
    expect_duplicate_name_error,
    expect_error,
    fp32,
    multi_rank_only,
    random_tensor,
    reducescatter_input,
    reducescatter_reference,
    scale_reference,
    sum_of_equal_terms,
    threshold,
)


# ----- alltoall ----------------------------------------------------------------------
def test_alltoall():
    rank, size = hvd.rank(), hvd.size()
    for dtype, dim in itertools.product(ALL_TYPES, DIMS):
        splits = torch.tensor([rank + 1] * size, dtype=torch.int32)
        collected, received = hvd.alltoall(alltoall_input(dim, dtype, size), splits)
        collected, = fp32(collected)
        assert collected.min() == rank and collected.max() == rank
        assert collected.numel() == size * (size + 1) // 2 * 2 ** (dim - 1)
        assert received.tolist() == [r + 1 for r in range(size)]


def test_alltoall_equal_split():
    rank, size = hvd.rank(), hvd.size()
    for dtype, dim in itertools.product(ALL_TYPES, DIMS):
        collected, = fp32(hvd.alltoall(alltoall_input(dim, dtype, size)))
        assert collected.min() == rank and collected.max() == rank
        assert collected.numel() == size * (size + 1) // 2 * 2 ** (dim - 1)


def test_alltoall_type_error():
    multi_rank_only()
    size = hvd.size()
    tensor = torch.empty(size, dtype=torch.int32) if hvd.rank() % 2 else torch.empty(size, dtype=torch.float32)
    expect_error(lambda: hvd.alltoall(tensor), RuntimeError)


def test_alltoall_equal_split_length_error():
    multi_rank_only()
    expect_error(lambda: hvd.alltoall(torch.empty(hvd.size() + 1)), ValueError)


def test_alltoall_splits_error():
    size = hvd.size()
    expect_error(lambda: hvd.alltoall(torch.empty(size - 1), torch.ones(size, dtype=torch.int32)), ValueError)


def test_alltoall_splits_type_error():
    size = hvd.size()
    expect_error(lambda: hvd.alltoall(torch.empty(size), torch.empty(size, dtype=torch.float32)), ValueError)


def test_alltoall_rank_error():
    multi_rank_only()
    tensor_size = [2 * hvd.size()] * 3
    tensor_size[1] = 10 * (hvd.rank() + 1)
    expect_error(lambda: hvd.alltoall(torch.ones(tensor_size)), RuntimeError)


def test_alltoall_grad():
    rank, size = hvd.rank(), hvd.size()
    for dtype, dim, with_splits in itertools.product(GRAD_TYPES, DIMS, [True, False]):
        tensor = alltoall_input(dim, dtype, size).requires_grad_()
        if with_splits:
            collected, _ = hvd.alltoall(tensor, torch.tensor([rank + 1] * size, dtype=torch.int32))
        else:
            collected = hvd.alltoall(tensor)
        collected.backward(torch.ones(collected.shape, dtype=dtype))
        assert np.linalg.norm(np.ones(tensor.shape) - tensor.grad.numpy()) < 1e-8


# ----- reducescatter -----------------------------------------------------------------
def test_reducescatter():
    rank, size = hvd.rank(), hvd.size()
    for dtype, rows in itertools.product([torch.int32, torch.float32, torch.float64], [size * 3, size * 3 + 1]):
        tensor = reducescatter_input(rows, rank, dtype)
        total, mine = reducescatter_reference(rows, range(size), rank, dtype)
        summed = hvd.reducescatter(tensor, op=hvd.Sum)
        assert torch.equal(summed, total[mine]), (dtype, summed, total)
        averaged = hvd.reducescatter(tensor)  # Average by default
        reference = (total.double() / size).to(dtype)[mine]
        assert torch.allclose(averaged.double(), reference.double()), dtype


def test_reducescatter_grad():
    size = hvd.size()
    for op, expected in [(hvd.Sum, size), (hvd.Average, 1)]:
        tensor = torch.ones(size * 2, 3, dtype=torch.float64, requires_grad=True)
        hvd.reducescatter(tensor, op=op).backward(torch.ones(2, 3, dtype=torch.float64))
        assert torch.allclose(tensor.grad, torch.full_like(tensor, float(expected))), (op, tensor.grad)


def test_reducescatter_async_fused():
    rank, size = hvd.rank(), hvd.size()
    tests, poll_false_once = [], False
    for dtype, dim in itertools.product(REDUCE_TYPES, DIMS):
        torch.manual_seed(1234)
        tensor = random_tensor(dim, dtype, side=size * 4)
        handle = hvd.reducescatter_async(tensor, op=hvd.Sum)
        poll_false_once = poll_false_once or not hvd.poll(handle)
        tests.append((dtype, fp32(tensor)[0][rank * 4:(rank + 1) * 4] * size, handle))
    assert poll_false_once or size == 1, "hvd.poll() always returns True, not an async op?"
    for dtype, expected, handle in tests:
        summed, = fp32(hvd.synchronize(handle))
        assert list(summed.shape) == list(expected.shape)
        assert (summed - expected).abs().max() <= threshold(dtype), dtype


def test_reducescatter_prescale_postscale():
    rank, size = hvd.rank(), hvd.size()
    np.random.seed(12345)
    for dtype, dim in itertools.product(REDUCE_TYPES, DIMS):
        torch.manual_seed(1234)
        factor = np.random.uniform()
        tensor = random_tensor(dim, dtype, side=size * 4)
        mine = slice(rank * 4, (rank + 1) * 4)
        # prescale: each term scaled (Horovod's rules), then a sum of `size` equal terms in the dtype.
        expected = sum_of_equal_terms(scale_reference(tensor, factor, dtype), size)
        summed, expected = fp32(hvd.reducescatter(tensor, op=hvd.Sum, prescale_factor=factor), expected[mine])
        assert torch.allclose(summed, expected, threshold(dtype)), ("prescale", dtype)
        # postscale: the sum (exact: integers below 2**11 times size), then scaled.
        summed = hvd.reducescatter(tensor, op=hvd.Sum, postscale_factor=factor)
        summed, expected = fp32(summed, scale_reference(tensor * size, factor, dtype)[mine])
        assert torch.allclose(summed, expected, threshold(dtype)), ("postscale", dtype)


def test_reducescatter_adasum():
    expect_error(lambda: hvd.reducescatter(torch.ones(4 * hvd.size()), op=hvd.Adasum), RuntimeError)


def test_reducescatter_error():
    multi_rank_only()
    tensor = random_tensor(3, side=17 + hvd.rank())
    expect_error(lambda: hvd.reducescatter(tensor, name="reducescatter_error1"), RuntimeError)


def test_reducescatter_type_error():
    multi_rank_only()
    expect_error(lambda: hvd.reducescatter(dtype_differs_by_rank()), RuntimeError)


def test_reducescatter_duplicate_name_error():
    multi_rank_only()
    expect_duplicate_name_error(lambda name: hvd.reducescatter_async(torch.FloatTensor(*[17] * 3), name=name))
