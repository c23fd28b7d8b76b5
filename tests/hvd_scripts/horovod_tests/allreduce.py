"""allreduce (sum, average, in place, async, scaled, Min/Max/Product, gradients, errors), grouped_allreduce."""

import itertools

import numpy as np
import torch

import trainbridge.hvd as hvd

from .common import (
    DIMS,
    GRAD_TYPES,
    REDUCE_TYPES,
    NotApplicable,
    dtype_differs_by_rank,
    expect_duplicate_name_error,
    expect_error,
    fp32,
    multi_rank_only,
    random_tensor,
    scale_reference,
    sum_of_equal_terms,
    threshold,
)


# ----- allreduce ---------------------------------------------------------------
def test_allreduce():
    size = hvd.size()
    for dtype, dim in itertools.product(REDUCE_TYPES, DIMS):
        torch.manual_seed(1234)
        tensor = random_tensor(dim, dtype)
        summed = hvd.allreduce(tensor, average=False)
        tensor, summed = fp32(tensor, summed)
        assert torch.allclose(summed, tensor * size, threshold(dtype)), dtype


def test_allreduce_average():
    for dtype, dim in itertools.product([torch.int32, torch.int64, torch.float32, torch.float64], DIMS):
        torch.manual_seed(1234)
        tensor = random_tensor(dim, dtype)
        averaged = hvd.allreduce(tensor, average=True)
        assert torch.allclose(averaged, tensor, threshold(dtype)), dtype
        assert torch.equal(hvd.allreduce(tensor), averaged), "Average must be the default op"


def test_allreduce_inplace():
    size = hvd.size()
    for dtype, dim in itertools.product(REDUCE_TYPES, DIMS):
        torch.manual_seed(1234)
        tensor = random_tensor(dim)
        multiplied = (tensor * size).to(dtype)
        tensor = tensor.to(dtype)
        hvd.allreduce_(tensor, average=False)
        tensor, multiplied = fp32(tensor, multiplied)
        assert torch.allclose(tensor, multiplied, threshold(dtype)), dtype


def test_allreduce_async_fused():
    size = hvd.size()
    tests, poll_false_once = [], False
    for dtype, dim in itertools.product(REDUCE_TYPES, DIMS):
        torch.manual_seed(1234)
        tensor = random_tensor(dim, dtype)
        handle = hvd.allreduce_async(tensor, average=False)
        poll_false_once = poll_false_once or not hvd.poll(handle)
        tests.append((dtype, fp32(tensor)[0] * size, handle))
    assert poll_false_once or size == 1, "hvd.poll() always returns True, not an async op?"
    for dtype, multiplied, handle in tests:
        summed, = fp32(hvd.synchronize(handle))
        assert torch.allclose(summed, multiplied, threshold(dtype)), dtype


def _scaled_allreduce_input(dim, dtype):
    """Horovod's input for the scaled allreduces: a factor in [0, 1) and a random tensor, both seeded."""
    torch.manual_seed(1234)
    np.random.seed(1234)
    return np.random.uniform(), random_tensor(dim, dtype)


def test_allreduce_prescale():
    size = hvd.size()
    for dtype, dim in itertools.product(REDUCE_TYPES, DIMS):
        factor, tensor = _scaled_allreduce_input(dim, dtype)
        summed = hvd.allreduce(tensor, average=False, prescale_factor=factor)
        expected = sum_of_equal_terms(scale_reference(tensor, factor, dtype), size)
        summed, expected = fp32(summed, expected)
        assert torch.allclose(summed, expected, threshold(dtype)), dtype


def test_allreduce_postscale():
    size = hvd.size()
    for dtype, dim in itertools.product(REDUCE_TYPES, DIMS):
        factor, tensor = _scaled_allreduce_input(dim, dtype)
        summed = hvd.allreduce(tensor, average=False, postscale_factor=factor)
        summed, multiplied = fp32(summed, scale_reference(tensor * size, factor, dtype))
        assert torch.allclose(summed, multiplied, threshold(dtype)), dtype


def test_allreduce_min_max_product():
    rank, size = hvd.rank(), hvd.size()
    tensor = torch.tensor([rank + 1.0, -(rank + 1.0)])
    assert hvd.allreduce(tensor, op=hvd.Min).tolist() == [1.0, -float(size)]
    assert hvd.allreduce(tensor, op=hvd.Max).tolist() == [float(size), -1.0]
    product = float(np.prod(np.arange(1, size + 1)))
    assert hvd.allreduce(tensor, op=hvd.Product).tolist() == [product, product * (-1) ** size]


def test_allreduce_error():
    multi_rank_only()
    rank = hvd.rank()
    tensor = random_tensor(3, side=17 + rank)
    expect_error(lambda: hvd.allreduce(tensor), RuntimeError)
    dims = [17, 23 * 57] if rank == 0 else [17, 23, 57]
    expect_error(lambda: hvd.allreduce(torch.FloatTensor(*dims).random_(-100, 100)), RuntimeError)


def test_allreduce_type_error():
    multi_rank_only()
    expect_error(lambda: hvd.allreduce(dtype_differs_by_rank()), RuntimeError)


def test_allreduce_duplicate_name_error():
    multi_rank_only()
    expect_duplicate_name_error(lambda name: hvd.allreduce_async(torch.FloatTensor(*[17] * 3), name=name))


def test_allreduce_grad():
    size = hvd.size()
    for dtype, dim in itertools.product(GRAD_TYPES, DIMS):
        torch.manual_seed(1234)
        tensor = random_tensor(dim, dtype).requires_grad_()
        summed = hvd.allreduce(tensor, average=False)
        summed.backward(torch.ones([17] * dim, dtype=dtype))
        assert np.linalg.norm(np.ones([17] * dim) * size - tensor.grad.numpy()) < 1e-8


def test_allreduce_grad_average():
    for dtype, dim in itertools.product(GRAD_TYPES, DIMS):
        torch.manual_seed(1234)
        tensor = random_tensor(dim, dtype).requires_grad_()
        averaged = hvd.allreduce(tensor, average=True)
        averaged.backward(torch.ones([17] * dim, dtype=dtype))
        assert np.linalg.norm(np.ones([17] * dim) - tensor.grad.numpy()) < 1e-8


def test_adasum_outside_horovodrun():
    if hvd.using_real_horovod:
        raise NotApplicable("Adasum is the real Horovod's own op under horovodrun")
    try:
        hvd.allreduce(torch.ones(4), op=hvd.Adasum)
        raise AssertionError("Adasum did not raise")
    except NotImplementedError as exc:
        assert "horovodrun" in str(exc) and "hvd.Average" in str(exc), str(exc)


# ----- grouped allreduce ----------------------------------------------------------
def test_grouped_allreduce():
    size = hvd.size()
    for dtype, dim in itertools.product(REDUCE_TYPES, DIMS):
        torch.manual_seed(1234)
        tensors = [random_tensor(dim, dtype) for _ in range(5)]
        summed = hvd.grouped_allreduce(tensors, average=False)
        averaged = hvd.grouped_allreduce(tensors, average=True)
        for t, s, a in zip(tensors, summed, averaged):
            t, s, a = fp32(t, s, a)
            assert torch.allclose(s, t * size, threshold(dtype)), dtype
            assert torch.allclose(a, t, threshold(dtype)), dtype


def test_grouped_allreduce_inplace():
    size = hvd.size()
    for dtype, dim in itertools.product(REDUCE_TYPES, DIMS):
        torch.manual_seed(1234)
        tensors = [random_tensor(dim) for _ in range(5)]
        multiplied = [(t * size).to(dtype) for t in tensors]
        tensors = [t.to(dtype) for t in tensors]
        hvd.grouped_allreduce_(tensors, average=False)
        for t, m in zip(tensors, multiplied):
            t, m = fp32(t, m)
            assert torch.allclose(t, m, threshold(dtype)), dtype


def test_grouped_allreduce_grad():
    size = hvd.size()
    for dtype, dim, average in itertools.product(GRAD_TYPES, DIMS, [False, True]):
        torch.manual_seed(1234)
        tensors = [random_tensor(dim, dtype).requires_grad_() for _ in range(5)]
        for s in hvd.grouped_allreduce(tensors, average=average):
            s.backward(torch.ones([17] * dim, dtype=dtype))
        expected = np.ones([17] * dim) * (1 if average else size)
        for tensor in tensors:
            assert np.linalg.norm(expected - tensor.grad.numpy()) < 1e-8
