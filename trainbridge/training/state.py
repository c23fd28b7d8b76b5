"""Everything a run needs to continue exactly where it stopped.

A checkpoint is a plain dict (nanoGPT-style) of the model, optimizer and
scheduler state dicts, the progress counters, every rank's RNG state, the best
metric so far, the config, and the backend and world size that wrote it.
``snapshot``/``restore`` are the in-memory form that Horovod's elastic mode
saves on every commit and broadcasts to new workers.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Dict, Optional

import torch

FORMAT = "trainbridge-checkpoint-1"  # the tag of a checkpoint of this layout (read_checkpoint checks both)


@dataclasses.dataclass
class Progress:
    epoch: int = 0  # the epoch in progress, 0-based
    position: int = 0  # samples of that epoch's global order already trained on
    step: int = 0  # optimizer steps in all
    samples: int = 0  # training samples in all (global)
    best_accuracy: Optional[float] = None
    best_loss: Optional[float] = None
    best_epoch: Optional[int] = None

    def improves(self, accuracy: Optional[float], loss: float) -> bool:
        """Higher validation accuracy is better; lower validation loss breaks ties (and decides alone for
        tasks without an accuracy, such as regression)."""
        if accuracy is None:
            return self.best_loss is None or loss < self.best_loss
        if self.best_accuracy is None:
            return True
        assert self.best_loss is not None  # recorded together with best_accuracy
        return (accuracy, -loss) > (self.best_accuracy, -self.best_loss)


class TrainState:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        progress: Progress,
        scaler: Optional[torch.amp.GradScaler] = None,
    ) -> None:
        self.model, self.optimizer, self.scheduler, self.progress = model, optimizer, scheduler, progress
        self.scaler = scaler  # --amp fp16: the loss scale is state too

    def snapshot(self) -> Dict[str, Any]:
        """A deep copy of the trainable state and counters (no RNG: that is per rank)."""
        return copy.deepcopy(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self._scaler_state(),
                "progress": dataclasses.asdict(self.progress),
            }
        )

    def _scaler_state(self) -> Optional[Dict[str, Any]]:
        return self.scaler.state_dict() if self.scaler is not None else None

    def restore(self, snapshot: Dict[str, Any]) -> None:
        self.model.load_state_dict(snapshot["model"])
        self.optimizer.load_state_dict(snapshot["optimizer"])
        self.scheduler.load_state_dict(snapshot["scheduler"])
        if self.scaler is not None and snapshot.get("scaler"):
            self.scaler.load_state_dict(snapshot["scaler"])
        self.progress = Progress(**snapshot["progress"])

    def checkpoint(self, *, config: Dict[str, Any], backend: str, world_size: int, batch_size: int) -> Dict[str, Any]:
        """The checkpoint dict; ``Job.save`` adds every rank's RNG state under "rng"."""
        p = self.progress
        return {
            "format": FORMAT,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self._scaler_state(),
            "progress": dataclasses.asdict(p),
            # Readable summaries of the same counters (the contract of final.pt and the README).
            "epoch": p.epoch,
            "step": p.step,
            "step_in_epoch": p.position // (world_size * batch_size),
            "sampler": {"seed": config["seed"], "epoch": p.epoch, "position": p.position},
            "best": {"val_accuracy": p.best_accuracy, "val_loss": p.best_loss, "epoch": p.best_epoch},
            "config": config,
            "backend": backend,
            "world_size": world_size,
            "batch_size": batch_size,
        }
