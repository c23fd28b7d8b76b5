"""Model registry: ``--model NAME`` -> a freshly initialised ``nn.Module``.

Both registries have the one shape of :mod:`trainbridge.plugins`,
``name -> "module:function"``, imported on use (torchvision is slow to import).
"""

from __future__ import annotations

from typing import Dict, Optional

from torch import nn

from ..plugins import resolve

# Models for in-memory MNIST: built with no arguments.
MODELS: Dict[str, str] = {
    "convnet-bn": "trainbridge.models.mnist:convnet_bn",
    "convnet-dropout": "trainbridge.models.mnist:convnet_dropout",
    "mlp": "trainbridge.models.mnist:mlp",
    "plaincnn": "trainbridge.models.mnist:plaincnn",
}

# Image classifiers for image-folder tasks: built with the number of classes and an
# optional weights file.
CLASSIFIERS: Dict[str, str] = {
    "resnet34": "trainbridge.models.resnet:resnet34_classifier",
}


def build_model(name: str) -> nn.Module:
    return resolve(name, MODELS, "model")()


def build_classifier(name: str, num_classes: int, weights_path: Optional[str] = None) -> nn.Module:
    return resolve(name, CLASSIFIERS, "image classifier")(num_classes, weights_path)
