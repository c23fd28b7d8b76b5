"""Your own model, data and loop, distributed by trainbridge: one file for every launcher.

    python examples/own_loop.py --output-dir runs/own                  # one process
    python examples/own_loop.py --output-dir runs/own --nproc 2        # two local workers
    torchrun --nproc-per-node 2 examples/own_loop.py --output-dir runs/own
    horovodrun -np 2 python examples/own_loop.py --output-dir runs/own
    mpirun -np 2 python examples/own_loop.py --output-dir runs/own

It trains a small MLP on scikit-learn's 8x8 digits (bundled, no download).
``--global-batch`` is the batch of one optimizer step over all ranks, so every
world size trains the same model. Run it again after a crash or SIGTERM and it
continues from DIR/last.pt exactly where it stopped; DIR/final.pt holds the weights.
"""
from __future__ import annotations

import argparse
import os

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

import trainbridge as tb


def digits(dtype):
    """1500 training and 297 validation images of 8x8 pixels, 10 classes."""
    data = load_digits()
    x = torch.tensor(data.data, dtype=dtype) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    return TensorDataset(x[:1500], y[:1500]), TensorDataset(x[1500:], y[1500:])


@torch.no_grad()
def evaluate(job, model, dataset):
    """Exact loss and accuracy: each sample on one rank, sums reduced over ranks."""
    model.eval()
    totals = torch.zeros(3, device=job.device, dtype=torch.float64)  # loss sum, correct, count
    for x, y in job.eval_loader(dataset, batch_size=128):
        logits = model(x)
        totals += torch.stack([nn.functional.cross_entropy(logits, y, reduction="sum").double(),
                               (logits.argmax(1) == y).sum().double(), torch.tensor(len(y), device=job.device)])
    model.train()
    loss, correct, count = job.allreduce(totals, "sum").tolist()
    return loss / count, correct / count


def main(args) -> None:
    job = tb.init(backend=args.backend, timeout=args.timeout)
    job.print(f"{job.world_size} rank(s) under {job.launcher}: backend {job.backend_name}, device {job.device}")
    if args.global_batch % job.world_size:
        raise tb.UserError(f"--global-batch {args.global_batch} is not divisible by the {job.world_size} ranks; "
                           f"pick a multiple of {job.world_size}", quiet=not job.is_main)  # one line, from rank 0
    dtype = torch.float64 if args.float64 else torch.float32
    train_set, val_set = digits(dtype)

    torch.manual_seed(0)  # the same initial weights on every rank (prepare also broadcasts rank 0's)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # --shard: each rank keeps 1/N of the weights, gradients and optimizer state (FSDP2, torch backend).
    model, optimizer = job.prepare(model, optimizer, amp=args.amp, shard=args.shard)
    loader = job.train_loader(train_set, global_batch_size=args.global_batch, seed=0, num_workers=args.workers)
    total_steps = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / total_steps)

    # Everything a restart needs; job.save adds every rank's RNG state.
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader, "step": 0}
    last = os.path.join(args.output_dir, "last.pt")
    if os.path.exists(last):
        job.load(last, into=state)
        job.print(f"resumed from {last}: epoch {loader.epoch + 1}, step {state['step']}")

    while loader.epoch < args.epochs:
        epoch = loader.epoch
        for x, y in loader:
            optimizer.zero_grad()
            with job.autocast():
                loss = nn.functional.cross_entropy(model(x), y)
            job.backward(loss)
            job.step(optimizer)
            scheduler.step()
            state["step"] += 1
            if job.should_stop():  # SIGTERM on any rank: every rank stops at this step
                job.save(state, last)
                job.print(f"stopped by SIGTERM after step {state['step']}; run the same command to resume")
                job.exit(143)
            if args.checkpoint_every and state["step"] % args.checkpoint_every == 0:
                job.save(state, last, background=True)  # written while training goes on
        job.drain_stop()
        val_loss, val_accuracy = evaluate(job, model, val_set)
        job.save(state, last, background=True)
        job.print(f"epoch {epoch + 1} step {state['step']}: val_loss {val_loss:.4f} val_accuracy {val_accuracy:.4f}")

    # job.state_dict: the whole model (a sharded one gathered), so final.pt is one plain file.
    job.save({"model": job.state_dict(model), "step": state["step"], "world_size": job.world_size},
             os.path.join(args.output_dir, "final.pt"))
    job.print(f"done: wrote {args.output_dir}/final.pt")
    job.exit(0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--checkpoint-every", type=int, default=0, help="also write last.pt every N steps")
    p.add_argument("--global-batch", type=int, default=60, help="samples per optimizer step over all ranks")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    p.add_argument("--float64", action="store_true",
                   help="train in float64: world sizes then agree to rounding (float32 differs by ~1e-5 after "
                        "75 steps, from the order in which ranks sum gradients)")
    p.add_argument("--amp", default="off", choices=["off", "bf16", "fp16"])
    p.add_argument("--shard", action="store_true", help="shard the model over the ranks (torch backend)")
    p.add_argument("--backend", default="auto", help="auto, torch, horovod or local")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--nproc", type=int, default=1, help="without a launcher: start N local workers")
    return p.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    raise SystemExit(tb.spawn(main, arguments.nproc, arguments) if arguments.nproc > 1 else main(arguments))
