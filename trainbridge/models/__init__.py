"""Model registry: ``--model NAME`` -> a freshly initialised ``nn.Module``."""
from __future__ import annotations

import importlib
from typing import Callable, Dict, Optional

from torch import nn

from ..errors import UserError
from . import mnist

MODELS: Dict[str, Callable[[], nn.Module]] = {
    "convnet-bn": mnist.convnet_bn,
    "convnet-dropout": mnist.convnet_dropout,
    "mlp": mnist.mlp,
    "plaincnn": mnist.plaincnn,
}


# Image classifiers for image-folder tasks: built with the number of classes and an
# optional weights file; "module:function", imported on use (torchvision is slow to import).
CLASSIFIERS: Dict[str, str] = {
    "resnet34": "trainbridge.models.resnet:resnet34_classifier",
}


def build_model(name: str) -> nn.Module:
    if name not in MODELS:
        raise UserError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return MODELS[name]()


def build_classifier(name: str, num_classes: int, weights_path: Optional[str] = None) -> nn.Module:
    if name not in CLASSIFIERS:
        raise UserError(f"unknown image classifier {name!r}; choose one of {', '.join(CLASSIFIERS)}")
    module_name, function_name = CLASSIFIERS[name].split(":")
    return getattr(importlib.import_module(module_name), function_name)(num_classes, weights_path)
