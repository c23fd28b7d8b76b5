"""A sharded model: ``job.prepare(model, optimizer, shard=True)`` (FSDP2 on the torch backend).

A small transformer-ish stack (three identical blocks of LayerNorm, attention and an MLP, each
sharded as one unit) trained with AdamW, gradient clipping (the global norm over the shards)
and two micro-batches per step (``job.no_sync``). After the first epoch an exact evaluation on
13 samples gives the ranks uneven shares (the model is gathered whole for it). Every rank holds
1/N of each parameter; the whole model, gathered by ``job.state_dict``, must be one process's.

Every run writes the sharded checkpoint OUT/sharded-step4 (a folder) mid-epoch 2; a run whose
OUT already holds it resumes from it, at whatever world size (tests/test_sharded.py resumes
2 ranks' on 3 and on 1). Under the Horovod backend ``shard=True`` must be refused in one line;
the program then trains the same model unsharded, which must match all the same.
"""
import os

import torch
import torch.nn.functional as F
from program_tools import finish
from torch import nn
from torch.utils.data import TensorDataset

import trainbridge as tb

NAME = "sharded"
GLOBAL_BATCH = 12
SAMPLES, EPOCHS = 36, 2  # 6 steps
SAVE_AT = 4
DIM = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attention = nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        h = self.norm(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x).mean(1)


def data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, 3, generator=g)
    return TensorDataset(x, x[:, :, :1].mean(1) * x[:, :, 1:2].mean(1))


def run(job, out_dir: str) -> None:
    with torch.random.fork_rng():
        torch.manual_seed(51)
        model = Stack()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    refused = None
    if job.backend_name == "horovod":
        try:
            job.prepare(model, optimizer, shard=True)
        except tb.UserError as error:
            refused = str(error)
        assert refused and "need the torch backend" in refused and "\n" not in refused, refused
        model, optimizer = job.prepare(model, optimizer)
    else:
        model, optimizer = job.prepare(model, optimizer, shard=True)
        held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
        whole = sum(v.numel() for k, v in initial.items())
        # Each rank holds its 1/N share (dim 0 split in N chunks: a little more on the first ranks).
        assert held <= whole // job.world_size + 200, (held, whole)
    loader = job.train_loader(data(SAMPLES, 52), global_batch_size=GLOBAL_BATCH, seed=53)
    evaluation = job.eval_loader(data(13, 54), batch_size=2)
    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0, "norms": [], "evaluated": []}
    checkpoint = os.path.join(out_dir, f"{NAME}-step{SAVE_AT}")
    resumed = os.path.exists(checkpoint)
    if resumed:
        job.load(checkpoint, into=state)
        job.print(f"{NAME}: resumed at step {state['step']}, epoch {loader.epoch}, sample {loader.position}")
    while loader.epoch < EPOCHS:
        for x, y in loader:
            optimizer.zero_grad()
            halves = list(zip(x.chunk(2), y.chunk(2)))
            for n, (xb, yb) in enumerate(halves):
                with job.no_sync(model, enabled=n < len(halves) - 1):
                    job.backward(F.mse_loss(model(xb), yb) * len(yb) / len(y))
            state["norms"].append(job.clip_grad_norm_(model, 0.05).item())
            job.step(optimizer)
            state["step"] += 1
            if state["step"] == SAVE_AT and not resumed:
                job.save(state, checkpoint)
        if loader.epoch == 1 and not state["evaluated"]:
            model.eval()
            with torch.no_grad():
                total = sum(F.mse_loss(model(x), y, reduction="sum") for x, y in evaluation)
            state["evaluated"].append(job.allreduce(torch.as_tensor(total), "sum").item())
            model.train()
    final = {k: v.cpu() for k, v in job.state_dict(model).items()}
    finish(job, out_dir, NAME, initial, final, norms=state["norms"], evaluated=state["evaluated"],
           steps=state["step"], resumed=resumed, refused=refused)


def check(saved, ref) -> None:
    assert (saved["steps"], saved["resumed"]) == (ref["steps"], False) == (EPOCHS * SAMPLES // GLOBAL_BATCH, False)
    # The global gradient norm before clipping, the same at every world size (and clipping took effect).
    assert max(abs(a - b) for a, b in zip(saved["norms"], ref["norms"])) < 1e-9, (saved["norms"], ref["norms"])
    assert max(ref["norms"]) > 0.05
    assert abs(saved["evaluated"][0] - ref["evaluated"][0]) < 1e-9, (saved["evaluated"], ref["evaluated"])
    assert (saved["refused"] is not None) == (saved["backend"] == "horovod")
