"""Sparse tensors: sparse_allreduce_async (on every rank and on a process set), nn.Embedding(sparse=True)
through DistributedOptimizer, with and without sparse_as_dense."""

import itertools

import torch

import trainbridge.hvd as hvd

from .common import EvenOddSets


def _random_sparse(*shape):
    t = torch.rand(*shape)
    t[t < 0.8] = 0
    return t.to_sparse()


def test_async_sparse_allreduce():
    """The allgather of indices and values equals the allreduce of the dense tensors (Horovod's test)."""
    torch.manual_seed(hvd.rank())
    tensors = [_random_sparse(d0, 10) for d0 in [17, 32, 81, 12, 15, 23, 22] * 2]
    reduced = [hvd.allreduce(t.to_dense()) for t in tensors]
    handles = [hvd.sparse_allreduce_async(t, op=hvd.Average, name=f"sparse.{i}") for i, t in enumerate(tensors)]
    for want, handle in zip(reduced, handles):
        got = handle()
        assert got.is_sparse and torch.allclose(want, got.to_dense(), 1e-6)
    summed = hvd.sparse_allreduce_async(tensors[0], op=hvd.Sum, name="sparse.sum")()
    assert torch.allclose(summed.to_dense(), hvd.allreduce(tensors[0].to_dense(), op=hvd.Sum), 1e-6)


def test_async_sparse_allreduce_process_sets():
    with EvenOddSets() as sets:
        torch.manual_seed(hvd.rank())
        tensors = [_random_sparse(d0, 10) for d0 in [17, 32, 81, 12]]
        reduced = [hvd.allreduce(t.to_dense(), process_set=sets.set) for t in tensors]
        handles = [hvd.sparse_allreduce_async(t, op=hvd.Average, name=f"ps.sparse.{i}", process_set=sets.set)
                   for i, t in enumerate(tensors)]
        for want, handle in zip(reduced, handles):
            assert torch.allclose(want, handle().to_dense(), 1e-6)


def test_sparse_embeddings():
    """Horovod's test, plus the check it lacks: every rank ends with the same, averaged update."""
    inputs = [torch.LongTensor([[1, 2, 4, 5], [4, 3, 2, 9]]), torch.LongTensor([[1, 3, 4], [4, 7, 9]])]
    inp = inputs[0] if hvd.rank() == 0 else inputs[1]
    for sparse_as_dense, opt_class in itertools.product([False, True], [torch.optim.SGD, torch.optim.SparseAdam]):
        torch.manual_seed(0)
        model = torch.nn.Embedding(10, 3, sparse=True)
        before = model.weight.detach().clone()
        opt = hvd.DistributedOptimizer(opt_class(list(model.parameters()), lr=0.1),
                                       named_parameters=model.named_parameters(), sparse_as_dense=sparse_as_dense)
        loss = model(inp).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert model.weight.grad.is_sparse, sparse_as_dense
        if opt_class is torch.optim.SGD:
            # Each rank's gradient counts how often each row is used: SGD moves by lr * the average count.
            counts = [torch.bincount(inputs[0 if r == 0 else 1].view(-1), minlength=10).float()
                      for r in range(hvd.size())]
            expected = before - 0.1 * (sum(counts) / hvd.size()).unsqueeze(1)
            assert torch.allclose(model.weight.detach(), expected, atol=1e-6), (sparse_as_dense, model.weight)
        weights = hvd.allgather(model.weight.detach().unsqueeze(0), name=f"sparse.{opt_class.__name__}")
        assert all(torch.equal(w, weights[0]) for w in weights), (sparse_as_dense, opt_class)
