"""ResNet34 for transfer learning: ImageNet backbone, new two-layer head, optional frozen backbone.

Weights, in order of precedence:

* ``--no-pretrained``            -- random initialisation (seeded by the loop);
* ``--pretrained-weights PATH``  -- a resnet34 state_dict file (torchvision's
  ``resnet34-b627a593.pth``, or a trainbridge checkpoint's ``model``); its fc
  layer, if any, is ignored;
* otherwise                      -- torchvision's ImageNet weights from the torch
  hub cache (``$TORCH_HOME/hub/checkpoints``), downloaded once when missing.
  :func:`ensure_imagenet_weights` runs in the task's ``prepare`` (main rank
  first), so a download happens once per node.

torchvision is imported inside functions: ``--help`` and MNIST runs stay fast.
"""

from __future__ import annotations

import functools
import os
import socket
from typing import Dict, Optional

import torch
from torch import nn

from ..errors import UserError, first_line

HEAD_PREFIX = "fc."  # the new head; everything else is the backbone
FEATURES = 512  # resnet34's pooled feature width


def imagenet_weights_url() -> str:
    from torchvision.models import ResNet34_Weights

    return ResNet34_Weights.IMAGENET1K_V1.url


def cached_weights_path() -> str:
    """Where torchvision keeps (or would keep) the ImageNet resnet34 weights."""
    return os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(imagenet_weights_url()))


def ensure_imagenet_weights() -> str:
    """Path of the cached ImageNet weights, downloading them if missing; UserError when offline."""
    path = cached_weights_path()
    if os.path.isfile(path):
        return path
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(20)  # an unreachable host must not stall start-up for minutes
    try:
        torch.hub.load_state_dict_from_url(imagenet_weights_url(), progress=False, check_hash=True)
    except Exception as exc:  # noqa: BLE001 - URLError, HTTPError, OSError, RuntimeError (hash)
        raise UserError(
            f"no ImageNet weights for resnet34 in {path} and the download failed ({first_line(exc)}); "
            f"pass --no-pretrained to train from scratch, or --pretrained-weights PATH "
            f"to a resnet34 state_dict file"
        ) from None
    finally:
        socket.setdefaulttimeout(previous)
    return path


def load_backbone_state(path: str) -> Dict[str, torch.Tensor]:
    """The backbone tensors of a resnet34 state_dict file (plain, or a checkpoint dict with ``model``)."""
    if not os.path.isfile(path):
        raise UserError(
            f"--pretrained-weights {path} does not exist; give a resnet34 state_dict file or use --no-pretrained"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise UserError(
            f"cannot load --pretrained-weights {path} ({first_line(exc)}); "
            f"give a resnet34 state_dict saved with torch.save"
        ) from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict):
        raise UserError(f"--pretrained-weights {path} holds a {type(state).__name__}, not a state_dict")
    return {k: v for k, v in state.items() if not k.startswith(HEAD_PREFIX)}


@functools.lru_cache(maxsize=None)
def freezable_resnet_class() -> type:
    """Defined on first use, so that importing this module does not import torchvision."""
    from torchvision.models.resnet import ResNet

    class FreezableResNet(ResNet):
        """torchvision's ResNet (same state_dict keys) whose frozen backbone stays in eval mode.

        A frozen backbone must not change at all: its BatchNorm layers keep their
        running statistics (eval mode) even while the loop calls ``model.train()``.
        """

        backbone_frozen = False

        def train(self, mode: bool = True) -> "FreezableResNet":
            super().train(mode)
            if self.backbone_frozen:
                for name, module in self.named_children():
                    if name != "fc":
                        module.eval()
            return self

    return FreezableResNet


def resnet34_classifier(num_classes: int, weights_path: Optional[str] = None) -> nn.Module:
    """resnet34 with fc replaced by Linear(512, 512) -> ReLU -> Linear(512, num_classes).

    ``weights_path``: a state_dict file whose backbone tensors are loaded (fc ignored);
    None keeps the random initialisation.
    """
    from torchvision.models.resnet import BasicBlock

    model = freezable_resnet_class()(BasicBlock, [3, 4, 6, 3])  # the resnet34 layout
    model.fc = nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.ReLU(), nn.Linear(FEATURES, num_classes))
    if weights_path is not None:
        backbone = load_backbone_state(weights_path)
        missing, unexpected = model.load_state_dict(backbone, strict=False)
        missing = [k for k in missing if not k.startswith(HEAD_PREFIX)]
        if missing or unexpected:
            raise UserError(
                f"{weights_path} is not a resnet34 state_dict: {len(missing)} backbone tensors missing "
                f"(e.g. {(missing or ['-'])[0]}), {len(unexpected)} unexpected "
                f"(e.g. {(unexpected or ['-'])[0]})"
            )
    return model


def freeze_backbone(model: nn.Module) -> nn.Module:
    """Train only the head: every non-fc parameter gets ``requires_grad=False``, BatchNorm statistics stay fixed.

    (The tutorial set ``p.require_grad = False``, a new attribute that froze nothing.)
    DDP skips parameters that need no gradient and Horovod hooks only the
    optimizer's, so the frozen ones cost no communication under either.
    """
    for name, parameter in model.named_parameters():
        parameter.requires_grad = name.startswith(HEAD_PREFIX)
    model.backbone_frozen = True  # type: ignore[assignment]  # any value at run time; the stubs say Tensor or Module
    model.train(model.training)  # apply eval mode to the backbone now
    return model
