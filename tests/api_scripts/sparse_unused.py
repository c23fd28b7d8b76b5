"""A sparse table that some rank leaves out of a backward pass, under ``prepare(find_unused_parameters=True)``.

    horovodrun -np 2 --gloo python tests/api_scripts/sparse_unused.py

Rank 1 leaves the ``extra`` table out at step 1, no rank uses it at step 2. After each
``job.backward`` every rank compares its gradients with one process's average of the
ranks' losses (float64): a table some rank used has the average, as a sparse tensor (the
rank that did not use it adds no rows); one no rank used keeps no gradient. Before prepare each
rank steps both optimizers on its own data (as a resume would leave them), so prepare must give
each optimizer rank 0's state. Rank 0 prints one JSON line, per rank: the optimizers' state
(sums of its tensors) after prepare, and per step the largest difference and the layouts.
"""
import copy
import json

import torch

import trainbridge as tb


class Tables(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.users = torch.nn.Embedding(8, 3, sparse=True)
        self.extra = torch.nn.Embedding(8, 3, sparse=True)
        self.head = torch.nn.Linear(3, 1)

    def forward(self, ids, use_extra):
        features = self.users(ids) + (self.extra(ids) if use_extra else 0)
        return self.head(features).square().mean()


def uses_extra(rank: int, step: int) -> bool:
    return step == 0 or (step == 1 and rank == 0)


torch.set_default_dtype(torch.float64)
job = tb.init(timeout=60)
torch.manual_seed(0)
model = Tables()
sparse_opt = torch.optim.SparseAdam([model.users.weight, model.extra.weight], lr=0.1)
dense_opt = torch.optim.Adam(model.head.parameters(), lr=0.1)
model(torch.tensor([job.rank, 4]), True).backward()  # each rank's own first step
sparse_opt.step()
dense_opt.step()
model, sparse_opt, dense_opt = job.prepare(model, sparse_opt, dense_opt, find_unused_parameters=True)
state = [float(sum(torch.as_tensor(v).sum() for v in per_param.values()))
         for opt in (sparse_opt, dense_opt) for per_param in opt.state.values()]
reference = copy.deepcopy(job.unwrap(model))
batches = [torch.tensor([1, 2, 2]), torch.tensor([5, 0, 7]), torch.tensor([3, 3, 6])][: job.world_size]
steps = []
for step in range(3):
    sparse_opt.zero_grad()
    dense_opt.zero_grad()
    reference.zero_grad()
    job.backward(model(batches[job.rank], uses_extra(job.rank, step)))
    for rank, ids in enumerate(batches):  # one process: the mean of the ranks' losses
        (reference(ids, uses_extra(rank, step)) / job.world_size).backward()
    diff, layouts = 0.0, {}
    for (name, ours), theirs in zip(job.unwrap(model).named_parameters(), reference.parameters()):
        layouts[name] = None if ours.grad is None else str(ours.grad.layout)
        if ours.grad is not None and theirs.grad is not None:
            diff = max(diff, (ours.grad.to_dense() - theirs.grad.to_dense()).abs().max().item())
        elif ours.grad is not None or theirs.grad is not None:
            diff = float("inf")
    job.step(sparse_opt)
    job.step(dense_opt)
    with torch.no_grad():  # the reference takes the averaged step: both stay at the same weights
        for ours, theirs in zip(model.parameters(), reference.parameters()):
            theirs.copy_(ours)
    steps.append({"diff": diff, "layouts": layouts})
job.print(json.dumps(job.allgather_object({"state": state, "steps": steps})))
job.exit(0)
