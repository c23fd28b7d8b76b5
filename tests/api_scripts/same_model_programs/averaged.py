"""Copies of the prepared model: ``AveragedModel(model)`` (an EMA) and ``copy.deepcopy(model)``, updated every step.

Made after ``job.prepare``, both copy rank 0's weights (each rank's model differs before it), so they are
the same on every rank, as in one process. Each is the plain user module (not a second DDP, no gradient
hooks): a backward pass through a copy averages nothing, so its gradients stay each rank's own, while the
prepared model's from the same batches are averaged.
"""
import copy
import os

import torch
import torch.nn.functional as F
from program_tools import finish, host_copy, per_rank_batch, plain_state
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import TensorDataset

NAME = "averaged"
GLOBAL_BATCH = 12


def copies_state(job, model, ema, shadow):
    return {**plain_state(job.unwrap(model)), **host_copy(ema.state_dict(), "ema."), **plain_state(shadow, "shadow.")}


def run(job, out_dir: str) -> None:
    g = torch.Generator().manual_seed(24)
    x = torch.randn(96, 5, generator=g)
    y = (x[:, 1] * x[:, 2] > 0).long()
    job.set_seed(800)
    module = nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 2))
    with torch.no_grad():
        module[0].bias.add_(job.rank)  # the ranks' models differ until prepare's broadcast
    model, optimizer = job.prepare(module, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    shadow = copy.deepcopy(model).requires_grad_(False)
    probe = copy.deepcopy(model)
    for name, copied in (("AveragedModel's module", ema.module), ("deepcopy", shadow), ("deepcopy", probe)):
        assert type(copied) is type(module) and not copied._forward_pre_hooks, f"{name}: {type(copied).__name__}"
        assert all(a is not b for a, b in zip(copied.parameters(), module.parameters()))
    initial = copies_state(job, model, ema, shadow)
    loader = job.train_loader(TensorDataset(x, y), batch_size=per_rank_batch(job, GLOBAL_BATCH), seed=8)
    for _epoch in range(3):
        for xb, yb in loader:
            optimizer.zero_grad()
            job.backward(F.cross_entropy(model(xb), yb))
            job.step(optimizer)
            ema.update_parameters(model)
            with torch.no_grad():
                for s, p in zip(shadow.parameters(), model.parameters()):
                    s.lerp_(p, 0.1)
    # A copy is not averaged: its gradients from each rank's own batch stay different.
    F.cross_entropy(probe(xb), yb).backward()
    grads = job.allgather(probe[0].weight.grad)
    assert all(not torch.equal(grads[0], other) for other in grads[1:]), "a deepcopy's gradients were averaged"
    # The prepared model's, from the same batches, are averaged: the same on every rank.
    optimizer.zero_grad()
    job.backward(F.cross_entropy(model(xb), yb))
    grads = job.allgather(job.unwrap(model)[0].weight.grad)
    assert all(torch.equal(grads[0], other) for other in grads[1:]), "the prepared model's gradients differ"
    optimizer.zero_grad()
    job.save({"model": model, "ema": ema, "shadow": shadow}, os.path.join(out_dir, "averaged_ckpt.pt"))
    finish(job, out_dir, NAME, initial, copies_state(job, model, ema, shadow))


def check(saved, ref) -> None:
    # The copies moved away from their start (copies left at the initial weights would also "agree").
    assert max((saved["final"][k] - saved["initial"][k]).abs().max().item()
               for k in saved["final"] if k.startswith(("ema.module", "shadow."))) > 1e-3
    assert saved["final"]["ema.n_averaged"].item() == ref["final"]["ema.n_averaged"].item() == 24  # one a step
