"""job.clip_grad_norm_ under prepare(amp="fp16"): the loss scale is taken out before clipping.

Prints, from rank 0, a JSON list with one row per rank: the norm job.clip_grad_norm_ returned, the norm of the
averaged gradients divided by the loss scale (what it must be), and the norm of the
gradients the step applied (at most max_norm once clipped).
"""
import json

import torch

import trainbridge as tb

MAX_NORM = 0.01

job = tb.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = job.prepare(model, optimizer, amp="fp16")
generator = torch.Generator().manual_seed(1 + job.rank)  # other data on each rank
x, y = torch.randn(16, 8, generator=generator), torch.randint(0, 2, (16,), generator=generator)
with job.autocast():
    loss = torch.nn.functional.cross_entropy(model(x), y)
job.backward(loss)
scaled = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
norm = job.clip_grad_norm_(model, MAX_NORM)
applied = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
job.step(optimizer)
row = {"rank": job.rank, "returned": float(norm), "expected": float(scaled / job.scaler.get_scale()),
       "scale": float(job.scaler.get_scale()), "applied": float(applied)}
job.print(json.dumps(job.allgather_object(row)))  # one line, from rank 0: the ranks' prints would interleave
job.exit(0)
