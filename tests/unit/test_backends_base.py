"""trainbridge.backends.base: what the backends share, in this process."""
import torch
from torch import nn

from trainbridge.backends.base import sparse_gradient_parameters


def test_sparse_gradient_parameters_are_those_of_sparse_embedding_tables():
    model = nn.ModuleDict({
        "users": nn.Embedding(4, 2, sparse=True),
        "bags": nn.EmbeddingBag(5, 2, mode="mean", sparse=True),
        "dense_table": nn.Embedding(3, 2),
        "head": nn.Sequential(nn.Linear(4, 1)),
    })
    found = sparse_gradient_parameters(model)
    assert found == {model["users"].weight, model["bags"].weight}
    # What it promises: those parameters, and no other, get sparse gradients.
    loss = model["users"](torch.tensor([1])).sum() + model["bags"](torch.tensor([[0, 4]])).sum()
    loss = loss + model["dense_table"](torch.tensor([2])).sum() + model["head"](torch.ones(1, 4)).sum()
    loss.backward()
    assert {p for p in model.parameters() if p.grad.is_sparse} == found
