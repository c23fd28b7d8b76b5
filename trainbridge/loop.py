"""The training loop, written once for every backend and every task.

Reads top to bottom: prepare the data (main rank first), build the model with
the same seed on every rank, let the backend wrap model and optimizer so that
``step()`` applies globally averaged gradients, then train and evaluate exactly.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Dict

import torch

from .backends import Backend
from .best_model import BestWeights
from .classification_report import report_model
from .config import TrainConfig
from .rank_agreement import learning_rates_per_rank
from .reporting import MetricsLog, StepTimer, peak_rss_mb, progress, set_postfix
from .tasks import Task, create_task


def build_optimizer(cfg: TrainConfig, params, world_size: int) -> torch.optim.Optimizer:
    # --scale-lr: with N ranks the global batch is N times larger (Goyal et al.).
    lr = cfg.lr * (world_size if cfg.scale_lr else 1)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.Adadelta(params, lr=lr)


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer):
    if cfg.scheduler == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.1,
                                                          patience=cfg.plateau_patience)
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=cfg.gamma)


@torch.no_grad()
def evaluate(model: torch.nn.Module, task: Task, split: str, backend: Backend, batch_size: int) -> Dict[str, float]:
    """Exact loss and accuracy over the whole split, whatever the world size.

    ``model`` must be the unwrapped module: under DDP a forward pass of the
    wrapper would broadcast buffers, a collective that hangs when ranks have
    different numbers of evaluation batches.
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=backend.device)  # loss sum, correct, count
    indices = backend.eval_shard(task.eval_size(split))
    for images, labels in task.eval_loader(split, indices, batch_size, backend.device):
        logits = model(images)
        totals[0] += task.loss(logits, labels, reduction="sum").double()
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += len(labels)
    # Each sample was seen by exactly one rank, so global sums are exact.
    loss_sum, correct, count = backend.allreduce(totals, "sum").tolist()
    model.train(was_training)
    return {f"{split}_loss": loss_sum / count, f"{split}_accuracy": correct / count}


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
    task = create_task(cfg.task)
    cfg.apply_task_defaults(task)
    with backend.main_first():  # a download happens once, on the main rank
        source = task.prepare(cfg, note=backend.print)
    backend.print(f"[trainbridge] {source}; backend={backend.name} world_size={backend.world_size} "
                  f"launcher={backend.env.launcher} device={backend.device}")

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = task.build_model(cfg).to(backend.device)
    optimizer = build_optimizer(cfg, task.trainable_parameters(model), backend.world_size)
    model, optimizer = backend.wrap(model, optimizer)
    scheduler = build_scheduler(cfg, optimizer)  # after wrap: schedulers patch optimizer.step
    torch.manual_seed(cfg.seed + backend.rank)  # but independent dropout masks per rank

    sampler = backend.train_sampler(task.train_size, cfg.seed)
    batches = task.train_loader(sampler, cfg.batch_size, backend.device)
    metrics = MetricsLog(cfg.output_dir, enabled=backend.is_main)
    timer = StepTimer(cfg.warmup_steps)
    step, samples, row = 0, 0, {}
    best = BestWeights()  # for the final report
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)  # a new shuffle per epoch, the same on every rank
        model.train()
        loss_sum = torch.zeros((), device=backend.device)  # summed on the device: no host sync per step
        seen = torch.zeros((), device=backend.device)
        bar = progress(batches, len(batches), f"epoch {epoch + 1}/{cfg.epochs}",
                       enabled=backend.is_main and not cfg.no_progress)
        for images, labels in bar:
            optimizer.zero_grad()  # set_to_none by default
            loss = task.loss(model(images), labels)
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
        timer.pause()

        train_loss_sum, train_seen = backend.allreduce(torch.stack([loss_sum, seen]).double(), "sum").tolist()
        samples += int(train_seen)
        row = {"epoch": epoch + 1, "step": step, "train_loss": train_loss_sum / max(train_seen, 1),
               **evaluate(backend.unwrap(model), task, "val", backend, cfg.batch_size),
               "lr": optimizer.param_groups[0]["lr"], "backend": backend.name, "world_size": backend.world_size,
               "launcher": backend.env.launcher, "seconds": round(time.time() - started, 3), "samples": samples}
        # The plateau scheduler steps on the globally reduced validation loss, so
        # every rank takes the same decision and learning rates never diverge.
        scheduler.step(row["val_loss"]) if cfg.scheduler == "plateau" else scheduler.step()
        # Each rank's learning rate for the next epoch; fails loudly if any rank disagrees.
        row["next_lr_per_rank"] = learning_rates_per_rank(optimizer, backend)
        best.update(row, backend.unwrap(model))
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

    # ----- final report: the best model (by val accuracy) on val and test --------
    # Collective: every rank scores its shard of the best weights; rank 0 prints
    # and writes report_<split>.json and confusion_<split>.png.
    report_model(best.model(backend.unwrap(model), backend), task, backend, cfg.batch_size, cfg.output_dir,
                 epoch=best.epoch)
    return final
