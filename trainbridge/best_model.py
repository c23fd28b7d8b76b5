"""The best weights seen so far, by validation accuracy (ties: lower validation loss).

Kept in host memory on every rank: the metrics that decide are global (allreduced),
so every rank keeps the same epoch, and the final report can score the best model
on all ranks at once.
"""
from __future__ import annotations

import copy
import math
from typing import Dict, Optional

import torch

from .backends import Backend


class BestWeights:
    def __init__(self) -> None:
        self.state: Optional[Dict[str, torch.Tensor]] = None
        self.epoch: Optional[int] = None
        self.accuracy = -math.inf
        self.loss = math.inf

    def update(self, metrics: Dict[str, float], model: torch.nn.Module) -> bool:
        """Copy ``model``'s state when ``metrics`` (an epoch row) beats the best; True when it did."""
        accuracy, loss = metrics["val_accuracy"], metrics["val_loss"]
        if accuracy < self.accuracy or (accuracy == self.accuracy and loss >= self.loss):
            return False
        self.state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        self.epoch, self.accuracy, self.loss = metrics["epoch"], accuracy, loss
        return True

    def model(self, like: torch.nn.Module, backend: Backend) -> torch.nn.Module:
        """A copy of ``like`` (the unwrapped model) holding the best weights, identical on every rank.

        Collective. Parameters are equal on all ranks by construction; buffers
        (BatchNorm running statistics) are not kept in step by every backend
        during training, so the main rank's are broadcast: the report then
        scores one model, whichever rank holds each sample.
        """
        best = copy.deepcopy(like)
        if self.state is not None:
            best.load_state_dict(self.state)
        buffers = backend.broadcast_object({k: v.cpu() for k, v in best.named_buffers()}, src=0)
        best.load_state_dict(buffers, strict=False)
        return best
