"""A user loop that draws random numbers everywhere a real one does, and resumes from DIR/last.pt.

Randomness: dropout in the model; random augmentation in the dataset (torch,
Python's random and numpy), loaded by DataLoader workers; numpy and Python noise
in the loop body itself. job.set_seed seeds the per-rank streams; job.save and
job.load must carry all of them for a resumed run to end bitwise equal.

    torchrun --nproc-per-node 2 random_loop.py OUT [--workers 2] [--epochs 6] [--global-batch 60]

Rank 0 appends, per step, the sorted ids of the step's samples over all ranks
to OUT/samples.txt, and writes OUT/final.pt.
"""
import argparse
import os
import random
import time

import numpy as np
import torch
from torch import nn

import trainbridge as tb


class NoisyDigits(torch.utils.data.Dataset):
    """Synthetic 16-feature samples; every read adds random noise: random augmentation."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(123)
        self.x = torch.randn(size, 16, generator=generator)
        self.y = (self.x[:, :4].sum(1) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        noise = 0.1 * torch.randn(16) + 0.01 * random.random() + 0.01 * float(np.random.rand())
        return self.x[i] + noise, self.y[i], i


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--global-batch", type=int, default=60)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--step-delay", type=float, default=0.0)
    args = p.parse_args()

    job = tb.init()
    job.set_seed(0, per_rank=False)  # the same initial weights everywhere
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = job.prepare(model, optimizer)
    loader = job.train_loader(NoisyDigits(1230), batch_size=args.global_batch // job.world_size, seed=7,
                              num_workers=args.workers)
    job.set_seed(1)  # dropout masks and loop noise: a stream per rank
    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
    last = os.path.join(args.out, "last.pt")
    if os.path.exists(last):
        job.load(last, into=state)
        job.print(f"resumed at step {state['step']}")

    while loader.epoch < args.epochs:
        for x, y, ids in loader:
            optimizer.zero_grad()
            x = x + 0.05 * torch.from_numpy(np.random.randn(*x.shape)).float()  # numpy noise in the loop
            smoothing = 0.1 * random.random()  # Python's random in the loop
            loss = nn.functional.cross_entropy(model(x), y, label_smoothing=smoothing)
            job.backward(loss)
            job.step(optimizer)
            state["step"] += 1
            seen = sorted(int(i) for rank_ids in job.allgather(ids) for i in rank_ids)
            if job.is_main:
                with open(os.path.join(args.out, "samples.txt"), "a") as f:
                    f.write(f"{state['step']} {' '.join(map(str, seen))}\n")
            time.sleep(args.step_delay)
            if job.should_stop():
                job.save(state, last)
                job.print(f"stopped by SIGTERM after step {state['step']}")
                job.exit(143)
            if args.checkpoint_every and state["step"] % args.checkpoint_every == 0:
                job.save(state, last)
    job.save({"model": model, "step": state["step"]}, os.path.join(args.out, "final.pt"))
    job.print(f"done after {state['step']} steps")
    job.exit(0)


if __name__ == "__main__":
    main()
