"""MNIST digits, held in memory and gathered by index (see :mod:`trainbridge.data.mnist`)."""
from __future__ import annotations

from typing import Iterable, List, Sequence

import torch

from ..data import MnistData, Split, iterate_batches, load_mnist
from ..models import build_model
from .base import Batch, Task


class IndexedBatches:
    """Re-iterable view: each pass reads the sampler's current order and gathers batches."""

    def __init__(self, split: Split, sampler: Iterable[int], batch_size: int, device: torch.device) -> None:
        self.split, self.sampler, self.batch_size, self.device = split, sampler, batch_size, device

    def __len__(self) -> int:
        return (len(self.sampler) + self.batch_size - 1) // self.batch_size

    def __iter__(self):
        return iterate_batches(self.split, list(self.sampler), self.batch_size, self.device)


class MnistTask(Task):
    name = "mnist"
    default_model = "convnet-dropout"
    default_optimizer = "adadelta"
    default_lr = 1.0
    default_scheduler = "step"

    def __init__(self) -> None:
        self.data: MnistData = None  # type: ignore[assignment]

    def prepare(self, cfg, note) -> str:
        self.data = load_mnist(cfg.dataset, cfg.resolved_data_root, note=note)
        return self.data.source

    def to_device(self, device: torch.device) -> None:
        """On a GPU, keep the whole set there: batches are gathered without host copies."""
        if device.type == "cuda":
            self.data = MnistData(*(Split(s.images.to(device), s.labels.to(device)) for s in self.data[:2]),
                                  self.data.source)

    @property
    def class_names(self) -> List[str]:
        return [str(d) for d in range(10)]

    @property
    def train_size(self) -> int:
        return len(self.data.train)

    def eval_size(self, split: str) -> int:
        return len(self.data.val) if split == "val" else 0

    def train_loader(self, sampler: Iterable[int], batch_size: int, device: torch.device) -> Iterable[Batch]:
        self.to_device(device)
        return IndexedBatches(self.data.train, sampler, batch_size, device)

    def eval_loader(self, split: str, indices: Sequence[int], batch_size: int, device: torch.device) -> Iterable[Batch]:
        return iterate_batches(self.data.val, indices, batch_size, device)

    def build_model(self, cfg) -> torch.nn.Module:
        return build_model(cfg.model or self.default_model)
