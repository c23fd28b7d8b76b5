"""Train at dataset sizes that are not a multiple of the global batch: the same samples and weights on any world size.

    python tests/api_scripts/dataset_sizes.py OUT_DIR
    torchrun --nproc-per-node 3 tests/api_scripts/dataset_sizes.py OUT_DIR
    horovodrun -np 3 --gloo python tests/api_scripts/dataset_sizes.py OUT_DIR

In one job, for 1000, 1001 and 1003 samples in turn: a tiny float64 MLP (no
dropout), 3 epochs, global batch 30 (30 // world_size per rank), SGD with momentum.
Rank 0 writes OUT_DIR/result.pt: the weights and the samples trained (summed over
ranks) per dataset size, the steps per epoch and the world size.
"""
import os
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import trainbridge as tb

SIZES = (1000, 1001, 1003)
EPOCHS = 3
GLOBAL_BATCH = 30


def synthetic(size):
    """``size`` samples of a smooth function of 8 features, the same on every rank."""
    generator = torch.Generator().manual_seed(1000 + size)
    x = torch.randn(size, 8, generator=generator, dtype=torch.float64)
    y = torch.sin(x[:, :4].sum(1, keepdim=True)) + 0.5 * x[:, 4:5] * x[:, 5:6]
    return TensorDataset(x, y)


def train(job, size):
    torch.manual_seed(size)  # the same initial weights on every rank and world size (the test rebuilds them)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = job.prepare(model, optimizer)
    loader = job.train_loader(synthetic(size), batch_size=GLOBAL_BATCH // job.world_size, seed=size)
    steps_per_epoch = len(loader)
    samples = 0
    for epoch in range(EPOCHS):
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            job.backward(loss)
            job.step(optimizer)
            samples += len(x)
        if loader.epoch != epoch + 1:
            raise RuntimeError(f"after pass {epoch} the loader is at epoch {loader.epoch}")
    trained = job.allreduce(torch.tensor(float(samples), dtype=torch.float64), "sum").item()
    weights = {k: v.detach().cpu().clone() for k, v in job.unwrap(model).state_dict().items()}
    job.print(f"{size} samples: trained {trained:.0f} over {EPOCHS} epochs of {steps_per_epoch} steps")
    return weights, int(trained), steps_per_epoch


if __name__ == "__main__":
    out_dir = sys.argv[1]
    job = tb.init()
    if GLOBAL_BATCH % job.world_size:
        raise tb.UserError(f"the global batch {GLOBAL_BATCH} is not divisible by {job.world_size} ranks")
    result = {"world_size": job.world_size, "weights": {}, "samples": {}, "steps_per_epoch": {}}
    for size in SIZES:
        weights, trained, steps = train(job, size)
        result["weights"][size], result["samples"][size], result["steps_per_epoch"][size] = weights, trained, steps
    if job.is_main:
        torch.save(result, os.path.join(out_dir, "result.pt"))
    job.barrier()
    job.shutdown()
