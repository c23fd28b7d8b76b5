"""``torch.compile`` before and after ``job.prepare``, with 2 micro-batches per step, the first under ``job.no_sync``.

One model is compiled and then prepared, another prepared and then compiled (the usual line).
Under ``no_sync`` the first micro-batch's gradients stay on each rank (checked: they differ between
ranks), the second averages the sum. ``job.save`` writes the keys of the uncompiled model, which load
into a fresh uncompiled one, and ``job.load`` puts them back into the compiled models.

The models compile with ``backend="aot_eager"``: dynamo, AOTAutograd's compiled backward and the
compiled wrappers as inductor has them, at a fraction of inductor's compile time (no C++ build).
"""
import os

import torch
import torch.nn.functional as F
from program_tools import finish, per_rank_batch, plain_state
from torch import nn
from torch.utils.data import TensorDataset

NAME = "compiled"
GLOBAL_BATCH = 12
ACCUMULATION = 2


class MLP(nn.Module):
    """A module class of the program's own: torch.compile of a DDP compiles the frames of the module inside it,
    and skips torch.nn's own classes (an nn.Sequential) there."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(5, 16), nn.Linear(16, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))


def counting_backend(graphs):
    """aot_eager, counting the graphs it compiles (a model left uncompiled would also match one process)."""
    from torch._dynamo.backends.registry import lookup_backend

    def compile_graph(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return lookup_backend("aot_eager")(gm, example_inputs)

    return compile_graph


def run(job, out_dir: str) -> None:
    g = torch.Generator().manual_seed(23)
    x = torch.randn(96, 5, generator=g)
    y = (x[:, 0] - x[:, 3] > 0).long()
    job.set_seed(700)
    graphs = {"before": [], "after": []}
    models, optimizers = {}, {}
    for when in ("before", "after"):
        module = MLP()
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        if when == "before":
            module = torch.compile(module, backend=counting_backend(graphs[when]))
        model, optimizer = job.prepare(module, optimizer)
        if when == "after":
            model = torch.compile(model, backend=counting_backend(graphs[when]))
        models[when], optimizers[when] = model, optimizer
    initial = {k: v for when, model in models.items() for k, v in plain_state(job.unwrap(model), f"{when}.").items()}
    loader = job.train_loader(TensorDataset(x, y), batch_size=per_rank_batch(job, GLOBAL_BATCH), seed=7)
    first_step = {}
    for _epoch in range(2):
        for i, (xb, yb) in enumerate(loader):
            accumulate = (i + 1) % ACCUMULATION != 0
            for when, model in models.items():
                if not accumulate and i + 1 == ACCUMULATION:  # the first micro-batch of the first step is in .grad
                    first_step[when] = job.allgather(job.unwrap(model).hidden.weight.grad)
                with job.no_sync(model, enabled=accumulate):
                    job.backward(F.cross_entropy(model(xb), yb) / ACCUMULATION)
                if not accumulate:
                    job.step(optimizers[when])
                    optimizers[when].zero_grad()
    for when, grads in first_step.items():
        # Under no_sync each rank kept its own micro-batch's gradient: no allreduce ran.
        assert all(not torch.equal(grads[0], other) for other in grads[1:]), f"{when}: no_sync averaged"
        assert graphs[when], f"compiled {when} prepare, but nothing was compiled"

    path = os.path.join(out_dir, "compiled_ckpt.pt")
    job.save({"before": models["before"], "after": models["after"]}, path)
    saved = torch.load(path, weights_only=True)
    for when, model in models.items():
        assert not [k for k in saved[when] if "_orig_mod" in k], f"{when}: saved keys {list(saved[when])[:3]}"
        fresh = MLP()
        fresh.load_state_dict(saved[when])  # strict: exactly the uncompiled model's keys
        assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), job.unwrap(model).parameters()))
    before = plain_state(job.unwrap(models["before"]))
    for p in job.unwrap(models["before"]).parameters():
        p.data.zero_()
    job.load(path, into={"before": models["before"], "after": models["after"]})  # into the compiled models
    assert all(torch.equal(before[k], v) for k, v in plain_state(job.unwrap(models["before"])).items())
    final = {k: v for when, model in models.items() for k, v in plain_state(job.unwrap(model), f"{when}.").items()}
    finish(job, out_dir, NAME, initial, final, compiled_graphs={k: len(v) for k, v in graphs.items()})


def check(saved, ref) -> None:
    assert all(saved["compiled_graphs"].values()) and all(ref["compiled_graphs"].values())
