"""What the ranks' same-model check costs against a training step (``tb.init(check_every=...)``).

    torchrun --standalone --nproc-per-node 2 benchmarks/same_model_check_cost.py --model mnist --steps 200
    torchrun --standalone --nproc-per-node 2 benchmarks/same_model_check_cost.py --model resnet34 --steps 20

Trains ``--steps`` steps of the workload of ``checkpoint_cost.py`` with the job's own check off
(``check_every=0``), timing each step, and after every step runs the check the job runs every
``check_every`` steps (:class:`trainbridge.api.same_model.SameModelCheck` on the prepared model),
timing it alone. Prints one JSON line per repeat and the medians: seconds per step, per check,
and the check's share of the step time at the default ``CHECK_EVERY``.
"""

import argparse
import json
import statistics
import time

import torch
from checkpoint_cost import workload
from torch import nn

import trainbridge as tb
from trainbridge.api.same_model import CHECK_EVERY, SameModelCheck


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["mnist", "resnet34"], default="mnist")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    job = tb.init(check_every=0)
    torch.manual_seed(0)
    model, optimizer, x, y = workload(args.model)
    model, optimizer = job.prepare(model, optimizer)
    x, y = x.to(job.device), y.to(job.device)
    check = SameModelCheck(job.backend, every=1)
    rows = []
    for repeat in range(args.repeats):
        steps, checks = [], []
        for _ in range(args.steps):
            started = time.perf_counter()
            optimizer.zero_grad()
            job.backward(nn.functional.cross_entropy(model(x), y))
            job.step(optimizer)
            between = time.perf_counter()
            check.check({"the prepared model": job.unwrap(model)}, "in the bench")
            steps.append(between - started)
            checks.append(time.perf_counter() - between)
        row = {"repeat": repeat, "step_s": statistics.median(steps), "check_s": statistics.median(checks)}
        rows.append(row)
        job.print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}))
    step_s = statistics.median(r["step_s"] for r in rows)
    check_s = statistics.median(r["check_s"] for r in rows)
    job.print(
        json.dumps(
            {
                "model": args.model,
                "world_size": job.world_size,
                "parameters": sum(p.numel() for p in model.parameters()),
                "step_s": round(step_s, 6),
                "check_s": round(check_s, 6),
                "check_over_step": round(check_s / step_s, 4),
                "check_every": CHECK_EVERY,
                "share_at_default": round(check_s / (CHECK_EVERY * step_s), 6),
            }
        )
    )
    job.exit(0)


if __name__ == "__main__":
    main()
