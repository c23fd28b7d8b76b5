"""Train a model with an ``nn.Embedding(sparse=True)`` through ``hvd.DistributedOptimizer``.

The same file runs under torchrun (trainbridge.hvd on torch.distributed) and under horovodrun
(trainbridge.hvd *is* horovod.torch); tests/test_hvd_api.py compares
the weights rank 0 saves to ``argv[1]``: one model whose sparse gradients travel as Horovod's
allgather of indices and values, one with ``sparse_as_dense=True``.
"""
import sys

import torch

import trainbridge.hvd as hvd

STEPS, ROWS, DIM, BATCH = 25, 40, 6, 16


def train(sparse_as_dense: bool) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(ROWS, DIM, sparse=True), torch.nn.Flatten(),
                                torch.nn.Linear(2 * DIM, 1))
    # Horovod: start every rank from rank 0's weights.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters(), sparse_as_dense=sparse_as_dense)
    data = torch.Generator().manual_seed(100 + hvd.rank())  # each rank its own shard
    for _ in range(STEPS):
        # Rank r draws from a rank-dependent range, so the ranks touch different (and shared) rows.
        indices = torch.randint(hvd.rank() * 5, ROWS - 5 + hvd.rank() * 5, (BATCH, 2), generator=data)
        target = indices.float().sum(dim=1, keepdim=True) / ROWS
        loss = torch.nn.functional.mse_loss(model(indices), target)
        optimizer.zero_grad()
        loss.backward()
        assert model[0].weight.grad.is_sparse
        optimizer.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for key, value in state.items():  # every rank ends with the same weights
        gathered = hvd.allgather(value.unsqueeze(0), name=f"check.{sparse_as_dense}.{key}")
        assert all(torch.equal(g, gathered[0]) for g in gathered), key
    return state


def main() -> None:
    hvd.init()
    torch.set_num_threads(1)
    result = {"sparse": train(False), "sparse_as_dense": train(True)}
    if hvd.rank() == 0:
        torch.save(result, sys.argv[1])
    print(f"EMBEDDING rank={hvd.rank()} size={hvd.size()} real_horovod={hvd.using_real_horovod}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
