"""Your own task for ``trainbridge train``: a regression with its own loss, metric and option.

    trainbridge train --task ./examples/own_task.py:Wave --output-dir runs/wave --epochs 5
    torchrun --nproc-per-node 2 -m trainbridge.train --task ./examples/own_task.py:Wave --output-dir runs/wave
    horovodrun -np 2 python -m trainbridge.train --task ./examples/own_task.py:Wave --output-dir runs/wave
    mpirun -np 2 python -m trainbridge.train --task ./examples/own_task.py:Wave --output-dir runs/wave

The command line brings everything else: launchers, resume, checkpoints,
metrics.jsonl, --amp, --accumulate. best.pt is the lowest validation loss, as
the task reports no accuracy. ``--noise`` is the task's own option.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.utils.data import TensorDataset

import trainbridge as tb
from trainbridge.tasks import option
from trainbridge.tasks.options import at_least


class Wave(tb.Task):
    """Fit y = sin(3x) + noise on x in [-1, 1] with a small MLP."""

    name = "wave"
    default_optimizer = "adam"
    default_lr = 1e-2

    @dataclasses.dataclass
    class Options:  # the task's own command-line options: --noise
        noise: float = option(0.05, help="standard deviation of the label noise (default: {default})",
                              check=at_least(0), same_on_resume=True)

    options: Options  # set by trainbridge from the command line

    def load_data(self, cfg, note) -> str:
        noise = self.options.noise
        generator = torch.Generator().manual_seed(0)  # the same data on every rank
        x = torch.rand(1200, 1, generator=generator) * 2 - 1
        y = torch.sin(3 * x) + noise * torch.randn(x.shape, generator=generator)
        self.splits = {"train": TensorDataset(x[:1000], y[:1000]), "val": TensorDataset(x[1000:], y[1000:])}
        return f"wave: 1000 train / 200 val points, noise {noise}"

    @property
    def train_dataset(self):
        return self.splits["train"]

    def eval_dataset(self, split):
        return self.splits.get(split)

    def build_model(self, cfg) -> nn.Module:
        return nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 1))

    def loss(self, outputs, targets, reduction="mean"):
        return nn.functional.mse_loss(outputs, targets, reduction=reduction)

    def metrics(self, outputs, targets):
        return {"mae": (outputs - targets).abs().sum()}  # sums: reported as val_mae over all ranks
