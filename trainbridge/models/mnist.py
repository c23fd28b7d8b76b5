"""The MNIST models of the PyTorch and Horovod MNIST tutorials. All return logits."""

from __future__ import annotations

from torch import nn


def convnet_bn() -> nn.Module:
    """conv 5x5 1->16->32, each with BatchNorm, ReLU and 2x2 max-pool, then fc 1568->10."""
    return nn.Sequential(
        nn.Conv2d(1, 16, kernel_size=5, padding=2),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, kernel_size=5, padding=2),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(7 * 7 * 32, 10),
    )


def convnet_dropout() -> nn.Module:
    """PyTorch's MNIST example: conv 3x3 1->16->32, max-pool, fc 4608->64->10 with dropout.

    Plain Dropout on the flattened features (Dropout2d on a 2-D input would drop
    whole rows and warn).
    """
    return nn.Sequential(
        nn.Conv2d(1, 16, 3),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Dropout(0.25),
        nn.Linear(12 * 12 * 32, 64),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(64, 10),
    )


def mlp() -> nn.Module:
    """784->128->128->10 with dropout 0.2."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 128),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(128, 128),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(128, 10),
    )


def plaincnn() -> nn.Module:
    """No dropout, no BatchNorm: a deterministic function of weights and data, for exact parity."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(12 * 12 * 32, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )
