"""Exact evaluation over ranks: every item of a 100-item dataset counted once, whatever the world size.

    torchrun --nproc-per-node 3 tests/api_scripts/eval_count.py OUT_DIR

Each rank writes OUT_DIR/shard-R.json with the items it scored; the main rank writes
OUT_DIR/totals.json with the allreduced count and sum, and every rank's items, gathered.
"""
import json
import os
import sys

import torch
from torch.utils.data import TensorDataset

import trainbridge as tb

SIZE = 100  # not divisible by 3: a padded sampler would count some items twice

if __name__ == "__main__":
    out_dir = sys.argv[1]
    job = tb.init()
    dataset = TensorDataset(torch.arange(SIZE, dtype=torch.float64))
    totals = torch.zeros(2, dtype=torch.float64)  # sum, count
    items = []
    for (values,) in job.eval_loader(dataset, batch_size=8):
        totals += torch.stack([values.sum(), torch.tensor(float(len(values)), dtype=torch.float64)])
        items += [int(v) for v in values]
    with open(os.path.join(out_dir, f"shard-{job.rank}.json"), "w") as f:
        json.dump({"rank": job.rank, "world_size": job.world_size, "items": items}, f)
    total_sum, count = job.allreduce(totals, "sum").tolist()
    seen = [i for shard in job.allgather_object(items) for i in shard]
    if job.is_main:
        with open(os.path.join(out_dir, "totals.json"), "w") as f:
            json.dump({"count": count, "sum": total_sum, "seen": seen}, f)
    job.print(f"count {count:.0f} sum {total_sum:.0f}")
    job.shutdown()
