"""The loop of ``trainbridge train``, written once on the public API for every backend and task.

Reads top to bottom: fetch missing data (main rank first), load it on every rank, build the model with
the same seed on every rank, resume from a checkpoint when there is one, let the
job prepare model and optimizer so that ``step()`` applies globally averaged
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
from typing import Any, Dict, Optional

import torch

from ..api import Job
from ..errors import UserError
from ..launch import detect_launch
from ..tasks import Task, create_task
from ..tasks.checks import check_model, check_splits
from .checkpoint import BEST, LAST, PREVIOUS, choose_resume, load_model_state, read_checkpoint, set_aside_previous_run
from .config import TrainConfig, changed_options
from .evaluation import check_first_batch, check_report_libraries, evaluate, report_model
from .fault_tolerance import Preempted, maybe_fail
from .loss_check import NonFiniteLossCheck
from .metrics import MetricsLog, StepTimer, peak_rss_mb, progress, set_postfix
from .optimizers import fused_kernels, load_keeping_kernels
from .rank_agreement import learning_rates_per_rank
from .state import Progress, TrainState
from .step import TrainStep, cpu_bf16_warning, memory_format

Row = Dict[str, Any]  # a metrics row: numbers, the backend's name, each rank's learning rate


def build_optimizer(cfg: TrainConfig, params, world_size: int) -> torch.optim.Optimizer:
    assert cfg.lr is not None and cfg.optimizer is not None  # apply_task_defaults has filled them
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
        return torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, mode="min", factor=0.1, patience=cfg.plateau_patience
        )
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=cfg.gamma)


def performance(timer: StepTimer, job: Job) -> Dict[str, object]:
    """Throughput after warm-up (summed over ranks), step-time percentiles and first-step time of rank 0, peak RSS."""
    timing = timer.summary()
    per_rank = job.allgather_object({"sps": timing["local_samples_per_second"], "rss": peak_rss_mb()})
    rates = [r["sps"] for r in per_rank]
    return {
        "samples_per_second": sum(rates) if None not in rates else None,
        "step_time_median": timing["step_time_median"],
        "step_time_p90": timing["step_time_p90"],
        "first_step_at": timer.first_step_at,
        "peak_rss_mb_per_rank": [round(r["rss"], 1) for r in per_rank],
    }


def find_checkpoint(cfg: TrainConfig, job: Job) -> Optional[dict]:
    """The checkpoint to resume from, the same on every rank, or None for a fresh start.

    The main rank chooses (and may move a corrupt file aside); every rank then
    loads the chosen file itself.
    """

    def choose():
        try:
            path = choose_resume(cfg.resume, cfg.output_dir, note=job.print)[0]
            own = [os.path.abspath(os.path.join(cfg.output_dir, name)) for name in (LAST, PREVIOUS)]
            if path is None or os.path.abspath(path) not in own:  # a fresh start in this folder
                set_aside_previous_run(cfg.output_dir, note=job.print)
            return "ok", path
        except UserError as exc:
            return "error", str(exc)

    status, path = job.decide_on_main(choose)
    if status == "error":
        raise UserError(path, quiet=not job.is_main)
    if path is None:
        return None
    checkpoint = read_checkpoint(path)
    checkpoint["path"] = path
    return checkpoint


def check_options(cfg: TrainConfig, job: Job, checkpoint: dict) -> None:
    """Resume only with the training options the checkpoint was trained with (or say which changed)."""
    changes = changed_options(checkpoint["config"], checkpoint["world_size"], cfg, job.world_size)
    if changes and not cfg.allow_option_changes:
        raise UserError(
            f"{checkpoint['path']} was trained with other options ({'; '.join(changes)}); resuming "
            f"would mix two runs: pass --allow-option-changes to continue with the new values, or "
            f"--resume never to start over (the old run is moved aside)",
            quiet=not job.is_main,
        )
    if changes:
        job.print(f"[trainbridge] resuming with changed options (--allow-option-changes): {'; '.join(changes)}")


def save_checkpoint(cfg: TrainConfig, job: Job, state: TrainState, best: bool = False, background: bool = True) -> None:
    """Write last.pt (and best.pt) on rank 0, in the background unless told otherwise.

    Every rank must call it: job.save gathers the RNG states.

    Weights that are no longer finite are never written over a finite checkpoint (every
    rank holds the same weights, so every rank stops here).
    """
    if not all(torch.isfinite(v).all() for v in state.model.state_dict().values() if v.is_floating_point()):
        raise UserError(
            f"the weights became NaN or infinite by step {state.progress.step}; "
            f"{cfg.output_dir}/{LAST} was not overwritten; lower --lr (now {cfg.lr})",
            quiet=not job.is_main,
        )
    checkpoint = state.checkpoint(
        config=cfg.saved(),
        backend=job.backend_name,
        world_size=job.world_size,
        batch_size=cfg.batch_size * cfg.accumulate,
    )
    job.save(
        checkpoint,
        os.path.join(cfg.output_dir, LAST),
        keep_previous=os.path.join(cfg.output_dir, PREVIOUS),
        background=background,
        copies=[os.path.join(cfg.output_dir, BEST)] if best else [],
    )


def train(cfg: TrainConfig, job: Job) -> Row:
    """Train per ``cfg``; the main rank writes checkpoints, ``metrics.jsonl`` and ``final.pt``."""
    started = time.time()
    task = create_task(cfg.task, cfg.task_options)
    task.processes_on_host = detect_launch().local_size  # a task never sees ranks: it is told what shares its cores
    cfg.apply_task_defaults(task)
    if cfg.fail_at_step is not None and cfg.fail_rank >= job.world_size:
        raise UserError(
            f"--fail-rank {cfg.fail_rank} does not exist in a job of {job.world_size} process(es), so "
            f"--fail-at-step would do nothing; use --fail-rank 0..{job.world_size - 1}",
            quiet=not job.is_main,
        )
    with job.main_first():  # a download happens once, on the main rank
        task.fetch(cfg, note=job.print)
    source = task.load_data(cfg, note=job.print)  # every rank at once: loading is not serialised
    check_splits(task, cfg.scheduler, quiet=not job.is_main)  # an empty validation split ends here, not after an epoch
    check_report_libraries(task, quiet=not job.is_main)  # and a missing matplotlib, not after the last one
    job.print(
        f"[trainbridge] {source}; backend={job.backend_name} world_size={job.world_size} "
        f"launcher={job.launcher} device={job.device}"
    )

    warning = cpu_bf16_warning(cfg.amp, job.device)
    if warning:
        job.print(warning)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    layout = memory_format(cfg.channels_last, job.device)
    model = check_model(task, task.build_model(cfg), quiet=not job.is_main)
    model = model.to(job.device, memory_format=layout)  # type: ignore[call-overload]  # stubs omit memory_format
    check_first_batch(model, task, job, cfg.batch_size)  # metrics that cannot be summed end here, not after an epoch
    optimizer = build_optimizer(cfg, task.trainable_parameters(model), job.world_size)
    checkpoint = find_checkpoint(cfg, job)
    progress_ = Progress()
    if checkpoint is not None:
        load_model_state(model, checkpoint["model"], checkpoint["path"])  # another model: its keys are named
        check_options(cfg, job, checkpoint)
        load_keeping_kernels(optimizer, checkpoint["optimizer"])
        progress_ = Progress(**checkpoint["progress"])
    model, optimizer = job.prepare(
        model,
        optimizer,
        amp=cfg.amp,
        compression=cfg.compression,
        shm_allreduce=cfg.shm_allreduce,
        sync_batchnorm=cfg.sync_batchnorm,
    )
    scheduler = build_scheduler(cfg, optimizer)  # after job.prepare: schedulers patch optimizer.step
    train_step = TrainStep(task, model, optimizer, job, cfg.batch_size, layout, cfg.compile)
    if checkpoint is not None:
        # The scheduler, the fp16 loss scale it had reached and every rank's random streams
        # (dropout continues with the masks the interrupted run would have drawn).
        job.restore(checkpoint, into={"scheduler": scheduler}, source=checkpoint["path"])
        job.print(
            f"[trainbridge] resuming from {checkpoint['path']} (written by {checkpoint['backend']} with "
            f"{checkpoint['world_size']} processes): epoch {progress_.epoch + 1}, "
            f"sample {progress_.position} of the epoch, step {progress_.step}"
        )
    else:
        job.set_seed(cfg.seed)  # independent dropout masks per rank: seed + rank
    state = TrainState(job.unwrap(model), optimizer, scheduler, progress_, job.scaler)
    metrics = MetricsLog(cfg.output_dir, enabled=job.is_main, append=checkpoint is not None)
    timer = StepTimer(cfg.warmup_steps)
    run = EpochEnds(cfg, job, task, model, state, metrics, started)

    step_batch = cfg.batch_size * cfg.accumulate  # samples per rank and optimizer step
    loss_check = NonFiniteLossCheck(job)

    def diverged() -> str:
        last = os.path.join(cfg.output_dir, LAST)
        return (
            f"{last} is the last finite checkpoint; lower --lr (now {cfg.lr}) and resume with "
            f"--allow-option-changes, or start over with --resume never"
            if os.path.exists(last)
            else f"no checkpoint was written; lower --lr (now {cfg.lr})"
        )

    def run_epochs() -> Row:
        # Re-entered by Horovod elastic after a failure: the world may have changed,
        # so the loader is built here, from the live job.
        check_batch_norm(model, cfg, job)
        loader = job.train_loader(task.train_dataset, step_batch, seed=cfg.seed, **task.loader_options("train"))
        row: Row = {}
        p = state.progress
        while p.epoch < cfg.epochs and not reached(cfg, p):
            # The pass continues where the state is (a resume, or an elastic roll-back).
            loader.load_state_dict({**loader.state_dict(), "epoch": p.epoch, "position": p.position})
            model.train()
            loss_sum = torch.zeros((), device=job.device)  # summed on the device: no host sync per step
            seen = torch.zeros((), device=job.device)
            bar = progress(
                loader, len(loader), f"epoch {p.epoch + 1}/{cfg.epochs}", enabled=job.is_main and not cfg.no_progress
            )
            for images, labels in bar:
                maybe_fail(cfg.fail_at_step, cfg.fail_rank, job.rank, p.step + 1, cfg.output_dir)
                # DDP / Horovod hooks allreduce gradients during the (last) backward pass.
                loss = train_step(images, labels)
                loss_check.record(loss, p.step + 1)
                loss_sum += loss * len(labels)
                seen += len(labels)
                p.step += 1
                p.samples += loader.position - p.position
                p.position = loader.position
                timer.tick(len(labels))
                if p.step % cfg.log_every == 0:
                    loss_check.check(diverged)
                    set_postfix(bar, loss=loss.item())
                if job.should_stop():
                    loss_check.check(diverged)
                    save_checkpoint(cfg, job, state, background=False)  # on disk before the exit
                    raise Preempted(
                        f"stopped by {job.stop_signal} after step {p.step}; wrote {cfg.output_dir}/{LAST}; "
                        f"launch the same command again to resume"
                    )
                if cfg.checkpoint_every and p.step % cfg.checkpoint_every == 0:
                    loss_check.check(diverged)
                    save_checkpoint(cfg, job, state)
                    job.commit(state)
                if reached(cfg, p):
                    break
            else:  # the pass ran to its end: the epoch is complete
                p.epoch, p.position = p.epoch + 1, 0
            job.drain_stop()
            loss_check.check(diverged)
            timer.pause()
            row = run.end_of_epoch(loss_sum, seen)
        return row or run.evaluation_row()

    row = job.run_resilient(run_epochs, state)
    return run.finish({**row, **performance(timer, job)})


def check_batch_norm(model: torch.nn.Module, cfg: TrainConfig, job: Job) -> None:
    """BatchNorm cannot train on one sample: refuse --batch-size 1 (every batch is whole, so no other is short)."""
    training_norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]
    if training_norms and cfg.batch_size == 1:
        raise UserError(
            f"--batch-size 1 cannot train {cfg.model}: its BatchNorm layers need at least 2 samples per "
            f"batch; use --batch-size 2 or more",
            quiet=not job.is_main,
        )


def reached(cfg: TrainConfig, p: Progress) -> bool:
    return cfg.max_steps is not None and p.step >= cfg.max_steps


@dataclasses.dataclass
class EpochEnds:
    """What the end of an epoch and the end of the run share: built once, then each step reads its fields."""

    cfg: TrainConfig
    job: Job
    task: Task
    model: torch.nn.Module
    state: TrainState
    metrics: MetricsLog
    started: float

    def evaluation_row(self) -> Row:
        cfg, job, p = self.cfg, self.job, self.state.progress
        job.sync_buffers(job.unwrap(self.model))  # evaluate and save one set of BatchNorm statistics
        return {
            "epoch": p.epoch + (1 if p.position else 0) or 1,
            "step": p.step,
            **evaluate(job.unwrap(self.model), self.task, "val", job, cfg.batch_size),
            "lr": self.state.optimizer.param_groups[0]["lr"],
            "backend": job.backend_name,
            "world_size": job.world_size,
            "launcher": job.launcher,
            "device": str(job.device),
            "seconds": round(time.time() - self.started, 3),
            "samples": p.samples,
        }

    def end_of_epoch(self, loss_sum: torch.Tensor, seen: torch.Tensor) -> Row:
        """Evaluate, step the scheduler, log, and checkpoint (last.pt, and best.pt when it improved)."""
        cfg, job, state, p = self.cfg, self.job, self.state, self.state.progress
        train_loss_sum, train_seen = job.allreduce(torch.stack([loss_sum, seen]).double(), "sum").tolist()
        row = self.evaluation_row()
        row = {
            "epoch": row.pop("epoch"),
            "step": row.pop("step"),
            "train_loss": train_loss_sum / max(train_seen, 1),
            **row,
        }
        if p.position == 0:  # a completed epoch (not a --max-steps or preemption stop inside one)
            # The plateau scheduler steps on the globally reduced validation loss, so
            # every rank takes the same decision and learning rates never diverge.
            state.scheduler.step(row["val_loss"]) if cfg.scheduler == "plateau" else state.scheduler.step()
        # Each rank's learning rate for the next epoch; fails loudly if any rank disagrees.
        row["next_lr_per_rank"] = learning_rates_per_rank(state.optimizer, job)
        # No val_loss without a validation split: then no epoch is the best.
        improved = "val_loss" in row and p.improves(row.get("val_accuracy"), row["val_loss"])
        if improved:
            p.best_accuracy, p.best_loss, p.best_epoch = row.get("val_accuracy"), row["val_loss"], row["epoch"]
        save_checkpoint(cfg, job, state, best=improved)
        job.commit(state)
        self.metrics.write(row)
        scores = " ".join(
            f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items() if k.startswith("val_")
        )
        job.print(f"[trainbridge] epoch {row['epoch']} step {p.step}: train_loss {row['train_loss']:.4f} {scores}")
        return row

    def finish(self, row: Row) -> Row:
        cfg, job, p = self.cfg, self.job, self.state.progress
        final = {**row, "event": "final", "seconds": round(time.time() - self.started, 3)}
        self.metrics.write(final)
        job.save(
            {
                "model": job.unwrap(self.model).state_dict(),
                "step": p.step,
                "epoch": row["epoch"],
                "backend": job.backend_name,
                "world_size": job.world_size,
                "config": cfg.saved(),
            },
            os.path.join(cfg.output_dir, "final.pt"),
        )
        score = next(
            (f"{k} {final[k]:.4f}" for k in ("val_accuracy", "val_loss", "train_loss") if k in final),
            "no validation split",
        )
        job.print(
            f"[trainbridge] done: {score} after {p.step} steps in {final['seconds']:.1f}s; "
            f"wrote {cfg.output_dir}/final.pt"
        )

        # ----- final report: the best model (by val accuracy) on val and test --------
        # Collective: every rank scores its shard of best.pt's weights; rank 0 prints
        # and writes report_<split>.json and confusion_<split>.png.
        report_model(self.best_model(), self.task, job, cfg.batch_size, cfg.output_dir, epoch=p.best_epoch)
        return final

    def best_model(self) -> torch.nn.Module:
        """A copy of the model holding best.pt's weights (the current ones if none), the same on every rank.

        best.pt survives restarts, unlike a copy in memory; every rank reads it from
        the shared output directory once rank 0 has finished writing (the barrier).
        """
        best = copy.deepcopy(self.job.unwrap(self.model))
        self.job.wait_for_saves()  # best.pt may still be written in the background
        path = os.path.join(self.cfg.output_dir, BEST)
        if os.path.exists(path):
            best.load_state_dict(read_checkpoint(path)["model"])
        self.job.sync_buffers(best)
        return best
