"""EMA copies made before prepare: ``AveragedModel`` and a hand-written one (``deepcopy`` + ``lerp_``).

``job.set_seed`` before the model is built gives every rank the same initial weights until
prepare, so copies made then are the same on every rank, as in one process. ``job.save`` of
the model and its EMA copy checks that the ranks hold the same copies.
"""
import copy
import os

import torch
import torch.nn.functional as F
from program_tools import finish, host_copy, per_rank_batch, plain_state
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import TensorDataset

NAME = "ema_before"
GLOBAL_BATCH = 12


def run(job, out_dir: str) -> None:
    g = torch.Generator().manual_seed(22)
    x = torch.randn(96, 5, generator=g)
    y = (x[:, 0] * x[:, 1] > 0).long()
    job.set_seed(600)
    model = nn.Sequential(nn.Linear(5, 12), nn.ReLU(), nn.Linear(12, 2))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    shadow = copy.deepcopy(model).requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = job.prepare(model, optimizer)
    initial = {**plain_state(model), **host_copy(ema.state_dict(), "ema."), **plain_state(shadow, "shadow.")}
    loader = job.train_loader(TensorDataset(x, y), batch_size=per_rank_batch(job, GLOBAL_BATCH), seed=6)
    for _epoch in range(3):
        for xb, yb in loader:
            optimizer.zero_grad()
            job.backward(F.cross_entropy(model(xb), yb))
            job.step(optimizer)
            ema.update_parameters(job.unwrap(model))
            with torch.no_grad():
                for s, p in zip(shadow.parameters(), job.unwrap(model).parameters()):
                    s.lerp_(p, 0.1)
    job.save({"model": model, "ema": ema, "shadow": shadow}, os.path.join(out_dir, "ema_before_ckpt.pt"))
    final = {**plain_state(model), **host_copy(ema.state_dict(), "ema."), **plain_state(shadow, "shadow.")}
    finish(job, out_dir, NAME, initial, final)


def check(saved, ref) -> None:
    # The copies moved away from their start (an EMA left at the initial weights would also "agree").
    assert max((saved["final"][k] - saved["initial"][k]).abs().max().item()
               for k in saved["final"] if k.startswith(("ema.module", "shadow."))) > 1e-3
