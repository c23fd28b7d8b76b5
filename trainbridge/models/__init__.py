"""Model registry: ``--model NAME`` -> a freshly initialised ``nn.Module``."""
from __future__ import annotations

from typing import Callable, Dict

from torch import nn

from ..errors import UserError
from . import mnist

MODELS: Dict[str, Callable[[], nn.Module]] = {
    "convnet-bn": mnist.convnet_bn,
    "convnet-dropout": mnist.convnet_dropout,
    "mlp": mnist.mlp,
    "plaincnn": mnist.plaincnn,
}


def build_model(name: str) -> nn.Module:
    if name not in MODELS:
        raise UserError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return MODELS[name]()
