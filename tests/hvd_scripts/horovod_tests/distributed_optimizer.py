"""DistributedOptimizer: averaged gradients (compression, predivide, Sum), the hooks during backward,
backward_passes_per_step, unused parameters, synchronize/skip_synchronize and clipping, parameter
names, gradients switched on and off; Compression.fp16."""

import itertools
import warnings

import numpy as np
import torch
import torch.nn.functional as F

import trainbridge.hvd as hvd

from .common import (
    D_IN,
    D_OUT,
    OPTIMIZER_OPTIONS,
    H,
    NotApplicable,
    distributed_sgd,
    expect_error,
    multi_rank_only,
    new_optimizer,
    optimizer_classes,
    regression_batch,
)


def test_compression_fp16():
    tensor_size = [5] * 3
    for dtype in [torch.float32, torch.float64]:
        compressed, ctx = hvd.Compression.fp16.compress(torch.ones(tensor_size, dtype=dtype))
        assert compressed.dtype == torch.float16
        decompressed = hvd.Compression.fp16.decompress(compressed, ctx)
        assert decompressed.dtype == dtype and np.linalg.norm(np.ones(tensor_size) - decompressed.numpy()) < 1e-8
    for dtype in [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]:
        compressed, ctx = hvd.Compression.fp16.compress(torch.ones(tensor_size, dtype=dtype))
        assert compressed.dtype == dtype and hvd.Compression.fp16.decompress(compressed, ctx).dtype == dtype


def _averaged_gradients(compression=hvd.Compression.none, **options):
    """Gradients after step()'s synchronize, for rank-dependent data; compared with a local average."""
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = distributed_sgd(model, lr=0.0, compression=compression, **options)
    inputs = [torch.randn(5, 6, generator=torch.Generator().manual_seed(r)) for r in range(hvd.size())]
    optimizer.zero_grad()
    model(inputs[hvd.rank()]).sum().backward()
    optimizer.synchronize()
    reference = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    reference.load_state_dict(model.state_dict())
    for x in inputs:
        reference(x).sum().backward()
    with optimizer.skip_synchronize():
        optimizer.step()
    return [p.grad for p in model.parameters()], [p.grad / hvd.size() for p in reference.parameters()]


def test_distributed_optimizer_averages_gradients():
    for got, want in zip(*_averaged_gradients()):
        assert torch.allclose(got, want, atol=1e-6), (got, want)
    for got, want in zip(*_averaged_gradients(gradient_predivide_factor=2.0)):
        assert torch.allclose(got, want, atol=1e-6), (got, want)
    for got, want in zip(*_averaged_gradients(compression=hvd.Compression.fp16)):
        assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-2), (got, want)
    for got, want in zip(*_averaged_gradients(op=hvd.Sum)):
        assert torch.allclose(got, want * hvd.size(), atol=1e-5), (got, want)


def test_hooks_start_allreduce_during_backward():
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 1))
    optimizer = distributed_sgd(model)
    if hvd.size() == 1:
        raise NotApplicable("Horovod registers no hooks for a single process")
    model(torch.ones(2, 6)).sum().backward()
    # Every gradient's allreduce was submitted by a hook while backward ran, before step().
    assert len(optimizer._handles) == 4 and all(h is not None for h, _ in optimizer._handles.values())
    optimizer.step()


def test_backward_passes_per_step():
    multi_rank_only()
    model = torch.nn.Linear(3, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    optimizer = distributed_sgd(model, lr=1.0, backward_passes_per_step=2)
    optimizer.zero_grad()
    for _ in range(2):
        model(torch.full((1, 3), float(hvd.rank() + 1))).sum().backward()
        # Gradients accumulate locally: nothing is sent until the second pass.
        assert len(optimizer._handles) == 1
    optimizer.step()
    # Accumulated local gradient 2*(rank+1), averaged over ranks; SGD(lr=1) moves the weight by minus that.
    expected = -2.0 * sum(r + 1 for r in range(hvd.size())) / hvd.size()
    assert torch.allclose(model.weight, torch.full((1, 3), expected)), model.weight
    optimizer.set_backward_passes_per_step(1)
    optimizer.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()


def test_force_allreduce():
    """A parameter unused on one rank (grad None) is reduced as zeros; no rank waits."""
    multi_rank_only()
    rank = hvd.rank()
    x, y = regression_batch()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = torch.nn.Linear(D_IN, H), torch.nn.Linear(H, D_OUT), \
                torch.nn.Linear(D_OUT, D_OUT)

        def forward(self, x_):
            x1 = self.fc2(F.relu(self.fc1(x_)))
            return x1, self.fc3(F.relu(x1))

    for (_, opt_class), opt_params in itertools.product(optimizer_classes(), OPTIMIZER_OPTIONS):
        model = Net()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(new_optimizer(opt_class, opt_params, model),
                                             named_parameters=model.named_parameters())
        y_pred1, y_pred2 = model(x)
        loss = F.mse_loss(y_pred1 if rank == 0 else y_pred2, y, reduction="sum")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert model.fc3.weight.grad is not None  # rank 0 never used fc3, but got (zero-filled, averaged) gradients


def _synchronized(model, x):
    """Horovod's clipping set-up: the squared error of model(x) against 1, its gradients averaged by
    ``synchronize()``; the optimizer's ``step()`` is still to come."""
    y = torch.ones(1, 1).requires_grad_()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = distributed_sgd(model)
    loss = F.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.synchronize()
    return optimizer


def test_gradient_clipping():
    multi_rank_only()
    x = torch.ones(1, 1).requires_grad_()
    model = torch.nn.Linear(1, 1)
    model.weight = torch.nn.Parameter(torch.zeros(1, 1) + 0.5)
    model.bias = torch.nn.Parameter(torch.zeros(1))
    optimizer = _synchronized(model, x)
    prior_grad = model.weight.grad.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    assert abs(prior_grad) > abs(model.weight.grad.item())
    with optimizer.skip_synchronize():
        optimizer.step()


def test_synchronize_step_warning():
    multi_rank_only()
    x = torch.zeros(1, 1).requires_grad_()
    model = torch.nn.Linear(1, 1)
    optimizer = _synchronized(model, x)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        optimizer.step()
    assert any("optimizer.step() called without optimizer.skip_synchronize()" in str(w.message) for w in ws), ws


def test_no_named_parameters():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 100, 1), torch.nn.Conv2d(100, 1, 1))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    loss = model(torch.rand([1, 1, 100, 100])).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def test_optimizer_no_named_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 10))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD([{"params": model[0].parameters()},
                                                          {"params": model[1].parameters()}], lr=0.001))
    params = optimizer._parameter_names
    assert len(params) == len(set(params.values()))
    all_param_names = hvd.allgather_object(set(params.values()))
    assert len(all_param_names) == hvd.size() and all(names == all_param_names[0] for names in all_param_names)


def test_dynamic_requires_grad():
    """Gradients turned off and on between steps (a GAN's generator and discriminator)."""
    multi_rank_only()
    gen, disc = torch.nn.Conv2d(1, 10, 1), torch.nn.Conv2d(10, 1, 1)
    inp = torch.rand([1, 1, 100, 100])
    gen_opt, disc_opt = distributed_sgd(gen), distributed_sgd(disc)

    def train_step(train_generator=False, train_discriminator=False):
        for p in gen.parameters():
            p.requires_grad_(train_generator)
        for p in disc.parameters():
            p.requires_grad_(train_discriminator)
        gen_opt.zero_grad()
        disc_opt.zero_grad()
        disc(gen(inp)).sum().backward()
        for p in gen.parameters():
            assert train_generator == (p.grad is not None and p.grad.max().is_nonzero())
        for p in disc.parameters():
            assert train_discriminator == (p.grad is not None and p.grad.max().is_nonzero())
        if train_generator:
            gen_opt.step()
        if train_discriminator:
            disc_opt.step()

    for _ in range(10):
        train_step(train_generator=True)
        train_step(train_discriminator=True)


def test_missing_named_parameters():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 100, 1), torch.nn.Conv2d(100, 1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expect_error(lambda: hvd.DistributedOptimizer(optimizer, named_parameters=list(model.named_parameters())[0:1]),
                 ValueError)


def test_duplicate_names():
    net1, net2 = torch.nn.Conv2d(1, 1, 1), torch.nn.Conv2d(1, 1, 1)
    optimizer = torch.optim.SGD(itertools.chain(net1.parameters(), net2.parameters()), lr=0.1)
    named = itertools.chain(net1.named_parameters(), net2.named_parameters())
    expect_error(lambda: hvd.DistributedOptimizer(optimizer, named_parameters=named), ValueError)
