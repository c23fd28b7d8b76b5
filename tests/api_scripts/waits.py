"""Ranks that work long, stall, or wait in different calls; ``python waits.py MODE`` under torchrun.

The job's timeout is 8 s. Each mode trains 2 steps of a small model first:

* long_local_work: every rank then computes for 20 s without any collective (a long
  evaluation), then allreduces its result: must finish, exit 0.
* stall: rank 1 computes for 60 s while rank 0 waits in job.barrier.
* mismatch: rank 0 saves alone (a rank-0-only job.save) while rank 1 goes to job.barrier.
* stuck_worker: DataLoader workers stuck in __getitem__ (prefetching), then rank 1
  stalls; the job must end (no worker may keep the launcher's output open).
* stuck_read: the loop goes on to a batch that a stuck worker never delivers.
* step_short: rank 0 trains a third step while rank 1, a step short, goes to job.barrier.
* stop_one_rank: only rank 0 calls job.should_stop (its stop agreement) before each step.
"""
import os
import sys
import time

import torch
from torch import nn

import trainbridge as tb

MODE = sys.argv[1]


class Slow(torch.utils.data.Dataset):
    """In a worker, the first 4 samples load at once and any later one never returns (a stuck read)."""

    loaded = 0

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if torch.utils.data.get_worker_info() is not None:
            Slow.loaded += 1
            if Slow.loaded > 4:
                print(f"worker {os.getpid()} stuck", flush=True)
                time.sleep(3600)
        return torch.full((4,), float(i)), torch.tensor(i % 2)


def busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        torch.ones(64, 64) @ torch.ones(64, 64)


# Built before the job: a process's first optimizer imports torch._dynamo (seconds on a busy machine), and
# prepare's broadcast, the job's first collective, waits only 8 s for a rank still importing it (CI, once).
model, optimizer = nn.Linear(4, 2), torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1)
job = tb.init(timeout=8)
model, optimizer = job.prepare(model, optimizer)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
workers = 2 if MODE.startswith("stuck") else 0
loader = job.train_loader(Slow(), batch_size=2, num_workers=workers)
steps = 6 if MODE == "stuck_read" else 3 if MODE == "step_short" and job.rank == 0 else 2
for _step, (x, y) in zip(range(steps), loader):
    if MODE == "stop_one_rank" and job.rank == 0:
        job.should_stop()  # a collective rank 1 never calls
    optimizer.zero_grad()
    job.backward(nn.functional.cross_entropy(model(x), y))
    job.step(optimizer)
print(f"rank {job.rank} trained", flush=True)

if MODE == "long_local_work":
    busy(20)
    total = job.allreduce(torch.ones(1), "sum")
    job.print(f"finished: {total.item():.0f}")
elif MODE == "stall":
    if job.rank == 1:
        busy(60)
    job.barrier()
elif MODE == "mismatch":
    if job.is_main:
        job.save({"model": model}, os.path.join(sys.argv[2], "rank0.pt"))
    job.barrier()
elif MODE == "step_short":
    job.barrier()
elif MODE == "stuck_worker":
    if job.rank == 1:
        busy(60)
    job.barrier()
job.exit(0)
