"""Reentrant activation checkpointing (``use_reentrant=True``) around the model's last two layers and a middle block.

A reentrant checkpoint runs the backward pass of its segment as a backward pass of its own,
inside the node of the enclosing one: the gradients of the segment's layers come from that
inner pass, those of the layers before it from the outer pass afterwards. The model's gradients
must be averaged once all of them are there. One model checkpoints its last two layers (SGD
with momentum; its middle block non-reentrant), another also its middle block (AdamW); the last
two layers' forward runs twice a step (counted), the second time to recompute their activations
for the backward pass.
"""
import torch
import torch.nn.functional as F
from program_tools import finish, per_rank_batch, plain_state
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import TensorDataset

NAME = "reentrant"
GLOBAL_BATCH = 12
EPOCHS = 2


class Net(nn.Module):
    def __init__(self, middle_reentrant: bool) -> None:
        super().__init__()
        self.middle_reentrant = middle_reentrant
        self.inp = nn.Linear(6, 16)
        self.middle = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.hidden, self.out = nn.Linear(16, 16), nn.Linear(16, 2)
        self.segment_calls = 0

    def last_two(self, h):
        self.segment_calls += 1
        return self.out(torch.tanh(self.hidden(h)))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = checkpoint(self.middle, h, use_reentrant=self.middle_reentrant)
        return checkpoint(self.last_two, h, use_reentrant=True)


def run(job, out_dir: str) -> None:
    g = torch.Generator().manual_seed(25)
    x = torch.randn(96, 6, generator=g)
    y = (x[:, 0] * x[:, 5] + x[:, 2] > 0).long()
    job.set_seed(900)
    models, optimizers = {}, {}
    for name, middle_reentrant in (("last", False), ("both", True)):
        module = Net(middle_reentrant)
        if middle_reentrant:
            optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.01)
        else:
            optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        models[name], optimizers[name] = job.prepare(module, optimizer)
    initial = {k: v for name, model in models.items() for k, v in plain_state(model, f"{name}.").items()}
    loader = job.train_loader(TensorDataset(x, y), batch_size=per_rank_batch(job, GLOBAL_BATCH), seed=9)
    steps = 0
    for _epoch in range(EPOCHS):
        for xb, yb in loader:
            for name, model in models.items():
                optimizers[name].zero_grad()
                job.backward(F.cross_entropy(model(xb), yb))
                job.step(optimizers[name])
            steps += 1
    final = {k: v for name, model in models.items() for k, v in plain_state(model, f"{name}.").items()}
    finish(job, out_dir, NAME, initial, final, steps=steps,
           segment_calls={name: job.unwrap(model).segment_calls for name, model in models.items()})


def check(saved, ref) -> None:
    # Each checkpointed segment ran forward twice a step: the checkpoint really recomputed it.
    assert saved["steps"] == ref["steps"] == 96 // GLOBAL_BATCH * EPOCHS
    assert saved["segment_calls"] == {"last": 2 * saved["steps"], "both": 2 * saved["steps"]}
