"""Mistakes a user's loop makes, one per mode; each must end in one line ``trainbridge: error: ...``.

Rank-divergent inputs (run under a launcher with 2 ranks):
    dataset-size, seed, batch-size, lr, optimizer, second-optimizer, compression, shapes, allreduce-dtype,
    allreduce-shape, shm-on-sparse (shm_allreduce="on" for sparse gradients: refused where 2 ranks share a host),
    global-batch-uneven (a global batch the 2 ranks cannot share evenly),
    diverged-weight (a weight nudged on rank 1 after prepare; the job checks every CHECK_EVERY steps),
    copy-before-prepare (an EMA copy of per-rank initial weights, given to job.save)
Misuse in one process:
    init-twice, prepare-twice, save-not-a-dict, save-rng-key, save-numpy, save-namespace,
    save-namedtuple, save-path, save-lambda, batch-size-float, load-other-model, frozen-after-prepare
"MODE OUT": that mistake, left to end the job (tb.init's one line); prints "no error" if it went through.
"each OUT MODE...": those modes one after the other in one job, each in a folder OUT/MODE of its own; each
    UserError is caught and printed by rank 0 as "MODE: <its message>" (the job goes on to the next),
    "MODE: no error" if none came. Anything else is a bug and ends the job with its traceback.
"""
import argparse
import collections
import copy
import os
import pathlib
import sys

import numpy as np
import torch
from torch import nn

import trainbridge as tb

CHECK_EVERY = 4


def main(mode: str, out: str, *modes: str) -> None:
    job = tb.init(timeout=60, check_every=CHECK_EVERY)
    if mode != "each":
        misuse(job, mode, out)
        job.print("no error")
        job.exit(0)
    for each in modes:
        folder = os.path.join(out, each)
        os.makedirs(folder, exist_ok=True)  # by every rank
        try:
            misuse(job, each, folder)
        except tb.UserError as error:  # raised on every rank: the check compared every rank's value
            job.print(f"{each}: {error}")
        else:
            job.print(f"{each}: no error")
        job.barrier()
    job.exit(0)


def misuse(job: tb.Job, mode: str, out: str) -> None:
    rank = job.rank
    data = torch.utils.data.TensorDataset(torch.randn(1000 + (rank if mode == "dataset-size" else 0), 4))
    hidden = 8 + (rank if mode == "shapes" else 0)
    torch.manual_seed(rank)  # each rank its own initial weights: prepare gives every rank rank 0's
    model = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))
    ema = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1 if mode == "lr" else 1))
    if mode == "optimizer" and rank == 1:
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    if mode == "init-twice":
        tb.init()
    if mode == "second-optimizer":  # two optimizers, the second with a per-rank learning rate
        job.prepare(model, torch.optim.SGD(model[0].parameters(), lr=0.1),
                    torch.optim.SGD(model[2].parameters(), lr=0.1 * (rank + 1)))
    if mode == "shm-on-sparse":
        job.prepare(nn.EmbeddingBag(5, 4, sparse=True), shm_allreduce="on")
    compression = "fp16" if mode == "compression" and rank == 1 else "none"
    model, optimizer = job.prepare(model, optimizer, compression=compression)
    if mode == "prepare-twice":
        job.prepare(model, optimizer)
    batch_size = 2.5 if mode == "batch-size-float" else 10 + (rank if mode == "batch-size" else 0)
    if mode == "global-batch-uneven":
        job.train_loader(data, global_batch_size=13)
    loader = job.train_loader(data, batch_size=batch_size,
                              seed=rank if mode == "seed" else 0)
    if mode == "allreduce-dtype":
        job.allreduce(torch.ones(3) if rank == 0 else torch.ones(3, dtype=torch.int32), "sum")
    if mode == "allreduce-shape":
        job.allreduce(torch.ones(3 + rank), "sum")
    values = {"save-numpy": np.float64(0.5), "save-namespace": argparse.Namespace(lr=0.1),
              "save-namedtuple": collections.namedtuple("Point", "x y")(1, 2), "save-path": pathlib.Path(out),
              "save-lambda": lambda x: x}
    path = os.path.join(out, "ckpt.pt")
    if mode in values:
        job.save({"model": model, "extra": values[mode]}, path)
    if mode == "save-not-a-dict":
        job.save(model, path)
    if mode == "save-rng-key":
        job.save({"model": model, "rng": 1}, path)
    if mode == "copy-before-prepare":
        job.save({"model": model, "ema": ema}, path)
    if mode == "frozen-after-prepare":
        job.unwrap(model)[0].requires_grad_(False)
    if mode in ("diverged-weight", "frozen-after-prepare"):
        if rank == 1 and mode == "diverged-weight":
            with torch.no_grad():
                job.unwrap(model)[2].weight[1, 3] += 1e-6  # a few float32 ulps
        for step, (x,) in enumerate(loader, start=1):
            optimizer.zero_grad()
            try:
                job.backward(model(x).square().mean())
                job.step(optimizer)
            except tb.UserError as error:
                raise tb.UserError(f"{error} [after {step} step(s) of this mode]") from None
    if mode == "load-other-model":
        job.save({"model": model, "loader": loader}, path)
        other = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        job.load(path, into={"model": other})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *sys.argv[3:])
