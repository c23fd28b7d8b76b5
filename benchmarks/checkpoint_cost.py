"""Training time lost per checkpoint: synchronous vs background ``job.save``, one process.

    python benchmarks/checkpoint_cost.py --model resnet34 --steps 40 --every 5 --repeats 3
    python benchmarks/checkpoint_cost.py --model resnet34 --steps 40 --every 5 --repeats 3 --threads 1  # a core free

Trains ``--steps`` steps three ways, interleaved per repeat: no checkpoint, a
synchronous save every ``--every`` steps, a background save every ``--every``
steps. The time lost per checkpoint is (run time - run time without saves) /
number of saves. Prints one JSON line per repeat and the medians.
"""

import argparse
import json
import statistics
import tempfile
import time

import torch
from torch import nn

import trainbridge as tb


def workload(name: str):
    if name == "resnet34":
        from trainbridge.models.resnet import resnet34_classifier

        model = resnet34_classifier(3, None)
        return model, torch.optim.Adam(model.parameters(), lr=1e-4), torch.randn(16, 3, 64, 64), torch.randint(3, (16,))
    from trainbridge.models import build_model

    model = build_model("convnet-dropout")
    return model, torch.optim.Adadelta(model.parameters()), torch.randn(128, 1, 28, 28), torch.randint(10, (128,))


def run(job, args, mode: str, out: str) -> float:
    torch.manual_seed(0)
    model, optimizer, x, y = workload(args.model)
    model, optimizer = job.prepare(model, optimizer)
    x, y = x.to(job.device), y.to(job.device)
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        job.step(optimizer)
        if mode != "none" and step % args.every == 0:
            job.save(
                {"model": model, "optimizer": optimizer, "step": step},
                f"{out}/last.pt",
                keep_previous=f"{out}/previous.pt",
                background=mode == "background",
            )
    job.wait_for_saves()
    if job.device.type == "cuda":
        torch.cuda.synchronize()  # the GPU's queued steps are part of the run
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["mnist", "resnet34"], default="mnist")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (default: every core)")
    args = p.parse_args()
    job = tb.init(threads=args.threads)
    saves = args.steps // args.every
    lost = {"sync": [], "background": []}
    with tempfile.TemporaryDirectory() as out:
        for repeat in range(args.repeats):
            times = {mode: run(job, args, mode, out) for mode in ("none", "sync", "background")}
            for mode in lost:
                lost[mode].append((times[mode] - times["none"]) / saves)
            print(json.dumps({"repeat": repeat, **{k: round(v, 3) for k, v in times.items()}}))
    median = {mode: statistics.median(v) for mode, v in lost.items()}
    print(
        json.dumps(
            {
                "model": args.model,
                "steps": args.steps,
                "saves": saves,
                "lost_per_checkpoint_s": {k: round(v, 4) for k, v in median.items()},
                "background_over_sync": round(median["background"] / median["sync"], 3) if median["sync"] > 0 else None,
            }
        )
    )
    job.shutdown()


if __name__ == "__main__":
    main()
