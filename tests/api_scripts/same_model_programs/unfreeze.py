"""Gradual unfreezing (fastai, ULMFiT): a backbone frozen at prepare, unfrozen after the first epoch.

The optimizer holds every parameter from the start, the backbone in a group of its own with a
smaller learning rate (discriminative learning rates); only the head trains in epoch 0. From
epoch 1 the backbone trains too, though it required no gradient when the model was prepared,
and its gradients must be averaged like the head's.
"""
import torch
import torch.nn.functional as F
from program_tools import finish, per_rank_batch, plain_state
from torch import nn
from torch.utils.data import TensorDataset

NAME = "unfreeze"
GLOBAL_BATCH = 12


def run(job, out_dir: str) -> None:
    g = torch.Generator().manual_seed(21)
    x = torch.randn(96, 6, generator=g)
    y = (x[:, :2].sum(1) > x[:, 2]).long()
    job.set_seed(500)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    backbone, head = model[:4], model[4]
    backbone.requires_grad_(False)
    optimizer = torch.optim.AdamW([{"params": backbone.parameters(), "lr": 3e-3},
                                   {"params": head.parameters(), "lr": 1e-2}], weight_decay=0.01)
    model, optimizer = job.prepare(model, optimizer)
    initial = plain_state(model)
    loader = job.train_loader(TensorDataset(x, y), batch_size=per_rank_batch(job, GLOBAL_BATCH), seed=5)
    backbone_moved = []
    for epoch in range(3):
        if epoch == 1:
            job.unwrap(model)[:4].requires_grad_(True)
        before = job.unwrap(model)[0].weight.detach().clone()
        for xb, yb in loader:
            optimizer.zero_grad()
            job.backward(F.cross_entropy(model(xb), yb))
            job.clip_grad_norm_(model, 1.0)
            job.step(optimizer)
        backbone_moved.append(bool((job.unwrap(model)[0].weight != before).any()))
    finish(job, out_dir, NAME, initial, plain_state(model), backbone_moved=backbone_moved)


def check(saved, ref) -> None:
    assert saved["backbone_moved"] == ref["backbone_moved"] == [False, True, True]
