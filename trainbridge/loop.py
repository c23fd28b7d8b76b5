"""The training loop, written once for every backend.

Reads top to bottom: load data (main rank first), build the model with the same
seed on every rank, let the backend wrap model and optimizer so that ``step()``
applies globally averaged gradients, then train and evaluate exactly.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Dict

import torch
import torch.nn.functional as F

from .backends import Backend
from .config import TrainConfig
from .data import MnistData, Split, iterate_batches, load_mnist, num_batches
from .models import build_model
from .reporting import MetricsLog, StepTimer, peak_rss_mb, progress, set_postfix


def build_optimizer(cfg: TrainConfig, params, world_size: int) -> torch.optim.Optimizer:
    # --scale-lr: with N ranks the global batch is N times larger (Goyal et al.).
    lr = cfg.base_lr * (world_size if cfg.scale_lr else 1)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.Adadelta(params, lr=lr)


@torch.no_grad()
def evaluate(model: torch.nn.Module, split: Split, backend: Backend, batch_size: int) -> Dict[str, float]:
    """Exact loss and accuracy over the whole split, whatever the world size.

    ``model`` must be the unwrapped module: under DDP a forward pass of the
    wrapper would broadcast buffers, a collective that hangs when ranks have
    different numbers of evaluation batches.
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=backend.device)  # loss sum, correct, count
    for images, labels in iterate_batches(split, backend.eval_shard(len(split)), batch_size, backend.device):
        logits = model(images)
        totals[0] += F.cross_entropy(logits, labels, reduction="sum").double()
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += len(labels)
    # Each sample was seen by exactly one rank, so global sums are exact.
    loss_sum, correct, count = backend.allreduce(totals, "sum").tolist()
    model.train(was_training)
    return {"val_loss": loss_sum / count, "val_accuracy": correct / count}


def performance(timer: StepTimer, backend: Backend) -> Dict[str, object]:
    """Throughput after warm-up (summed over ranks), step-time percentiles of rank 0, peak RSS per rank."""
    timing = timer.summary()
    per_rank = backend.allgather_object({"sps": timing["local_samples_per_second"], "rss": peak_rss_mb()})
    rates = [r["sps"] for r in per_rank]
    return {"samples_per_second": sum(rates) if None not in rates else None,
            "step_time_median": timing["step_time_median"], "step_time_p90": timing["step_time_p90"],
            "peak_rss_mb_per_rank": [round(r["rss"], 1) for r in per_rank]}


def train(cfg: TrainConfig, backend: Backend) -> Dict[str, float]:
    """Train per ``cfg``; the main rank writes ``metrics.jsonl`` and ``final.pt``. Returns the last metrics."""
    started = time.time()
    with backend.main_first():  # a download happens once, on the main rank
        data: MnistData = load_mnist(cfg.dataset, cfg.resolved_data_root, note=backend.print)
    backend.print(f"[trainbridge] {data.source}; backend={backend.name} world_size={backend.world_size} "
                  f"launcher={backend.env.launcher} device={backend.device}")
    if backend.device.type == "cuda":  # gather batches on the GPU, no per-step host copy
        data = MnistData(*(Split(s.images.to(backend.device), s.labels.to(backend.device)) for s in data[:2]),
                         data.source)

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = build_model(cfg.model).to(backend.device)
    optimizer = build_optimizer(cfg, model.parameters(), backend.world_size)
    model, optimizer = backend.wrap(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=cfg.gamma)  # after wrap: it patches step()
    torch.manual_seed(cfg.seed + backend.rank)  # but independent dropout masks per rank

    sampler = backend.train_sampler(len(data.train), cfg.seed)
    metrics = MetricsLog(cfg.output_dir, enabled=backend.is_main)
    step, samples, row = 0, 0, {}
    timer = StepTimer(cfg.warmup_steps)
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)  # a new shuffle per epoch, the same on every rank
        indices = list(sampler)
        model.train()
        loss_sum = torch.zeros((), device=backend.device)  # summed on the device: no host sync per step
        seen = torch.zeros((), device=backend.device)
        bar = progress(iterate_batches(data.train, indices, cfg.batch_size, backend.device),
                       num_batches(len(indices), cfg.batch_size), f"epoch {epoch + 1}/{cfg.epochs}",
                       enabled=backend.is_main and not cfg.no_progress)
        for images, labels in bar:
            optimizer.zero_grad()  # set_to_none by default
            loss = F.cross_entropy(model(images), labels)
            loss.backward()  # DDP / Horovod hooks allreduce gradients during backward
            optimizer.step()
            loss_sum += loss.detach() * len(labels)
            seen += len(labels)
            step += 1
            timer.tick(len(labels))
            if step % cfg.log_every == 0:
                set_postfix(bar, loss=loss.item())
            if cfg.max_steps is not None and step >= cfg.max_steps:
                break
        scheduler.step()
        timer.pause()

        train_loss_sum, train_seen = backend.allreduce(torch.stack([loss_sum, seen]).double(), "sum").tolist()
        samples += int(train_seen)
        row = {"epoch": epoch + 1, "step": step, "train_loss": train_loss_sum / max(train_seen, 1),
               **evaluate(backend.unwrap(model), data.val, backend, cfg.batch_size),
               "backend": backend.name, "world_size": backend.world_size, "launcher": backend.env.launcher,
               "seconds": round(time.time() - started, 3), "samples": samples}
        metrics.write(row)
        backend.print(f"[trainbridge] epoch {row['epoch']} step {step}: train_loss {row['train_loss']:.4f} "
                      f"val_loss {row['val_loss']:.4f} val_accuracy {row['val_accuracy']:.4f}")
        if cfg.max_steps is not None and step >= cfg.max_steps:
            break

    final = {**row, "event": "final", "seconds": round(time.time() - started, 3), **performance(timer, backend)}
    metrics.write(final)
    backend.save_on_main({"model": backend.unwrap(model).state_dict(), "step": step, "epoch": row["epoch"],
                          "backend": backend.name, "world_size": backend.world_size,
                          "config": dataclasses.asdict(cfg)}, f"{cfg.output_dir}/final.pt")
    backend.print(f"[trainbridge] done: val_accuracy {final['val_accuracy']:.4f} after {step} steps "
                  f"in {final['seconds']:.1f}s; wrote {cfg.output_dir}/final.pt")
    return final
