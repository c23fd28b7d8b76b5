"""The training loop, written once for every backend and every task.

Reads top to bottom: prepare the data (main rank first), build the model with
the same seed on every rank, resume from a checkpoint when there is one, let the
backend wrap model and optimizer so that ``step()`` applies globally averaged
gradients, then train, checkpoint and evaluate exactly.

What survives a restart (see :mod:`trainbridge.training.checkpoint` and
:mod:`trainbridge.training.state`): model, optimizer, scheduler, epoch and position
in the epoch's shuffled order, step count, every rank's RNG state and the best
metric. A resumed run continues at the next unseen batch, so with the same world
size it ends with bitwise the same weights as an uninterrupted run.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import time
from typing import Dict, Optional

import torch

from ..backends import Backend
from .checkpoint import BEST, LAST, PREVIOUS, choose_resume, load_model_state, read_checkpoint
from .evaluation import report_model
from .config import TrainConfig
from ..errors import UserError
from .fault_tolerance import Preempted, StopSignal, Watchdog, maybe_fail
from .optimizers import fused_kernels, load_keeping_kernels
from .rank_agreement import learning_rates_per_rank
from .metrics import MetricsLog, StepTimer, peak_rss_mb, progress, set_postfix
from ..tasks import Task, create_task
from .state import Progress, TrainState, rng_state, set_rng_state
from .step import TrainStep, check_amp, cpu_bf16_warning, make_scaler, memory_format


def build_optimizer(cfg: TrainConfig, params, world_size: int) -> torch.optim.Optimizer:
    # --scale-lr: with N ranks the global batch is N times larger (Goyal et al.).
    lr = cfg.lr * (world_size if cfg.scale_lr else 1)
    params = list(params)
    kernels = fused_kernels(cfg.optimizer, params[0].device) if params else {}
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, **kernels)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, **kernels)
    return torch.optim.Adadelta(params, lr=lr, **kernels)


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer):
    if cfg.scheduler == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.1,
                                                          patience=cfg.plateau_patience)
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=cfg.gamma)


@torch.no_grad()
def evaluate(model: torch.nn.Module, task: Task, split: str, backend: Backend, batch_size: int,
             beat=lambda: None) -> Dict[str, float]:
    """Exact loss and accuracy over the whole split, whatever the world size.

    ``model`` must be the unwrapped module: a forward pass of the DDP wrapper
    may run collectives (buffer broadcasts, when enabled), which hang when ranks
    have different numbers of evaluation batches.
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
        beat()
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


def find_checkpoint(cfg: TrainConfig, backend: Backend) -> Optional[dict]:
    """The checkpoint to resume from, the same on every rank, or None for a fresh start.

    The main rank chooses (and may move a corrupt file aside); every rank then
    loads the chosen file itself.
    """
    def choose():
        try:
            return "ok", choose_resume(cfg.resume, cfg.output_dir, note=backend.print)[0]
        except UserError as exc:
            return "error", str(exc)

    status, path = backend.decide_on_main(choose)
    if status == "error":
        raise UserError(path, quiet=not backend.is_main)
    if path is None:
        return None
    checkpoint = read_checkpoint(path)
    checkpoint["path"] = path
    return checkpoint


def save_checkpoint(cfg: TrainConfig, backend: Backend, state: TrainState, best: bool = False) -> None:
    """Write last.pt (and best.pt) on rank 0. Every rank must call it: RNG states are gathered."""
    rng_states = backend.allgather_object(rng_state())
    checkpoint = state.checkpoint(rng_states=rng_states, config=dataclasses.asdict(cfg), backend=backend.name,
                                  world_size=backend.world_size, batch_size=cfg.batch_size * cfg.accumulate)
    backend.save_on_main(checkpoint, os.path.join(cfg.output_dir, LAST),
                         keep_previous=os.path.join(cfg.output_dir, PREVIOUS))
    if best:
        backend.save_on_main(checkpoint, os.path.join(cfg.output_dir, BEST))


def train(cfg: TrainConfig, backend: Backend) -> Dict[str, float]:
    """Train per ``cfg``; the main rank writes checkpoints, ``metrics.jsonl`` and ``final.pt``."""
    started = time.time()
    task = create_task(cfg.task)
    cfg.apply_task_defaults(task)
    with backend.main_first():  # a download happens once, on the main rank
        source = task.prepare(cfg, note=backend.print)
    backend.print(f"[trainbridge] {source}; backend={backend.name} world_size={backend.world_size} "
                  f"launcher={backend.env.launcher} device={backend.device}")

    check_amp(cfg.amp, backend.device)
    warning = cpu_bf16_warning(cfg.amp, backend.device)
    if warning:
        backend.print(warning)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    layout = memory_format(cfg.channels_last, backend.device)
    model = task.build_model(cfg).to(backend.device, memory_format=layout)
    optimizer = build_optimizer(cfg, task.trainable_parameters(model), backend.world_size)
    scaler = make_scaler(cfg.amp, backend.device)
    checkpoint = find_checkpoint(cfg, backend)
    progress_ = Progress()
    if checkpoint is not None:
        load_model_state(model, checkpoint["model"], checkpoint["path"])
        load_keeping_kernels(optimizer, checkpoint["optimizer"])
        progress_ = Progress(**checkpoint["progress"])
        if scaler is not None and checkpoint.get("scaler"):
            scaler.load_state_dict(checkpoint["scaler"])  # the loss scale it had reached
    model, optimizer = backend.wrap(model, optimizer, accumulate=cfg.accumulate, compression=cfg.compression,
                                    shm_allreduce=cfg.shm_allreduce)
    scheduler = build_scheduler(cfg, optimizer)  # after wrap: schedulers patch optimizer.step
    train_step = TrainStep(task, model, optimizer, backend, cfg.batch_size, cfg.amp, scaler, layout, cfg.compile)
    if checkpoint is not None:
        scheduler.load_state_dict(checkpoint["scheduler"])
        rngs = checkpoint["rng"]["torch"]
        if len(rngs) == backend.world_size:
            set_rng_state(rngs[backend.rank])
        else:  # another world size: fresh but reproducible per-rank streams
            torch.manual_seed(cfg.seed + backend.rank + 1_000_003 * progress_.step)
        backend.print(f"[trainbridge] resuming from {checkpoint['path']} (written by {checkpoint['backend']} with "
                      f"{checkpoint['world_size']} processes): epoch {progress_.epoch + 1}, "
                      f"sample {progress_.position} of the epoch, step {progress_.step}")
    else:
        torch.manual_seed(cfg.seed + backend.rank)  # independent dropout masks per rank
    state = TrainState(backend.unwrap(model), optimizer, scheduler, progress_, scaler)
    metrics = MetricsLog(cfg.output_dir, enabled=backend.is_main, append=checkpoint is not None)
    timer = StepTimer(cfg.warmup_steps)
    watchdog = Watchdog(cfg.timeout, backend.rank)

    step_batch = cfg.batch_size * cfg.accumulate  # samples per rank and optimizer step

    def run_epochs() -> Dict[str, float]:
        # Re-entered by Horovod elastic after a failure: the world may have changed,
        # so the sampler and the stop agreement are built here, from the live backend.
        sampler = backend.train_sampler(task.train_size, cfg.seed)
        batches = task.train_loader(sampler, step_batch, backend.device)
        stop = StopSignal(backend.allreduce_async)
        row: Dict[str, float] = {}
        p = state.progress
        while p.epoch < cfg.epochs and not reached(cfg, p):
            sampler.set_epoch(p.epoch, p.position)  # a new shuffle per epoch, the same on every rank
            model.train()
            loss_sum = torch.zeros((), device=backend.device)  # summed on the device: no host sync per step
            seen = torch.zeros((), device=backend.device)
            bar = progress(batches, len(batches), f"epoch {p.epoch + 1}/{cfg.epochs}",
                           enabled=backend.is_main and not cfg.no_progress)
            for images, labels in bar:
                maybe_fail(cfg.fail_at_step, cfg.fail_rank, backend.rank, p.step + 1, cfg.output_dir)
                # DDP / Horovod hooks allreduce gradients during the (last) backward pass.
                loss = train_step(images, labels)
                loss_sum += loss * len(labels)
                seen += len(labels)
                p.step += 1
                consumed = min(step_batch * backend.world_size, sampler.total_size - p.position)
                p.position += consumed
                p.samples += consumed
                timer.tick(len(labels))
                watchdog.beat()
                if p.step % cfg.log_every == 0:
                    set_postfix(bar, loss=loss.item())
                if stop.agreed():
                    save_checkpoint(cfg, backend, state)
                    raise Preempted(f"stopped by SIGTERM after step {p.step}; wrote {cfg.output_dir}/{LAST}; "
                                    f"launch the same command again to resume")
                if cfg.checkpoint_every and p.step % cfg.checkpoint_every == 0:
                    save_checkpoint(cfg, backend, state)
                    backend.commit(state)
                if reached(cfg, p):
                    break
            stop.drain()
            timer.pause()
            if p.position >= sampler.total_size:  # the epoch is complete
                p.epoch, p.position = p.epoch + 1, 0
            row = end_of_epoch(cfg, backend, task, model, state, metrics, loss_sum, seen, started, watchdog.beat)
        return row or evaluation_row(cfg, backend, task, model, state, started, watchdog.beat)

    row = backend.run_resilient(run_epochs, state)
    watchdog.disarm()
    return finish(cfg, backend, task, model, state, metrics, {**row, **performance(timer, backend)}, started)


def reached(cfg: TrainConfig, p: Progress) -> bool:
    return cfg.max_steps is not None and p.step >= cfg.max_steps


def evaluation_row(cfg, backend, task, model, state, started, beat) -> Dict[str, float]:
    p = state.progress
    backend.sync_buffers(backend.unwrap(model))  # evaluate and save one set of BatchNorm statistics
    return {"epoch": p.epoch + (1 if p.position else 0) or 1, "step": p.step,
            **evaluate(backend.unwrap(model), task, "val", backend, cfg.batch_size, beat),
            "lr": state.optimizer.param_groups[0]["lr"], "backend": backend.name, "world_size": backend.world_size,
            "launcher": backend.env.launcher, "seconds": round(time.time() - started, 3), "samples": state.progress.samples}


def end_of_epoch(cfg, backend, task, model, state, metrics, loss_sum, seen, started, beat) -> Dict[str, float]:
    """Evaluate, step the scheduler, log, and checkpoint (last.pt, and best.pt when it improved)."""
    p = state.progress
    train_loss_sum, train_seen = backend.allreduce(torch.stack([loss_sum, seen]).double(), "sum").tolist()
    row = evaluation_row(cfg, backend, task, model, state, started, beat)
    row = {"epoch": row.pop("epoch"), "step": row.pop("step"), "train_loss": train_loss_sum / max(train_seen, 1),
           **row}
    if p.position == 0:  # a completed epoch (not a --max-steps or preemption stop inside one)
        # The plateau scheduler steps on the globally reduced validation loss, so
        # every rank takes the same decision and learning rates never diverge.
        state.scheduler.step(row["val_loss"]) if cfg.scheduler == "plateau" else state.scheduler.step()
    # Each rank's learning rate for the next epoch; fails loudly if any rank disagrees.
    row["next_lr_per_rank"] = learning_rates_per_rank(state.optimizer, backend)
    improved = p.improves(row["val_accuracy"], row["val_loss"])
    if improved:
        p.best_accuracy, p.best_loss, p.best_epoch = row["val_accuracy"], row["val_loss"], row["epoch"]
    save_checkpoint(cfg, backend, state, best=improved)
    backend.commit(state)
    metrics.write(row)
    backend.print(f"[trainbridge] epoch {row['epoch']} step {p.step}: train_loss {row['train_loss']:.4f} "
                  f"val_loss {row['val_loss']:.4f} val_accuracy {row['val_accuracy']:.4f}")
    return row


def finish(cfg, backend, task, model, state, metrics, row, started) -> Dict[str, float]:
    p = state.progress
    final = {**row, "event": "final", "seconds": round(time.time() - started, 3)}
    metrics.write(final)
    backend.save_on_main({"model": backend.unwrap(model).state_dict(), "step": p.step, "epoch": row["epoch"],
                          "backend": backend.name, "world_size": backend.world_size,
                          "config": dataclasses.asdict(cfg)}, os.path.join(cfg.output_dir, "final.pt"))
    backend.print(f"[trainbridge] done: val_accuracy {final['val_accuracy']:.4f} after {p.step} steps "
                  f"in {final['seconds']:.1f}s; wrote {cfg.output_dir}/final.pt")

    # ----- final report: the best model (by val accuracy) on val and test --------
    # Collective: every rank scores its shard of best.pt's weights; rank 0 prints
    # and writes report_<split>.json and confusion_<split>.png.
    report_model(best_model(cfg, backend, model), task, backend, cfg.batch_size, cfg.output_dir, epoch=p.best_epoch)
    return final


def best_model(cfg: TrainConfig, backend: Backend, model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the model holding best.pt's weights (the current ones if none), the same on every rank.

    best.pt survives restarts, unlike a copy in memory; every rank reads it from
    the shared output directory once rank 0 has finished writing (the barrier).
    """
    best = copy.deepcopy(backend.unwrap(model))
    backend.barrier()
    path = os.path.join(cfg.output_dir, BEST)
    if os.path.exists(path):
        best.load_state_dict(read_checkpoint(path)["model"])
    backend.sync_buffers(best)
    return best
