"""Mistakes in a model that PyTorch accepts silently, refused by ``job.prepare`` in one line."""

from __future__ import annotations

import torch

from ..errors import UserError


def check_freezing_spelled_right(model: torch.nn.Module) -> None:
    """Refuse ``p.require_grad = False`` (no s): a new attribute that PyTorch ignores, so nothing is frozen."""
    for kind, named in (("parameter", model.named_parameters()), ("module", model.named_modules())):
        for name, obj in named:
            if "require_grad" in getattr(obj, "__dict__", {}):
                what = f"{kind} {name!r}" if name else "the model"
                raise UserError(
                    f"{what} has an attribute require_grad, which PyTorch ignores, so it is still "
                    f"trained; to freeze it set requires_grad = False (with an s), or "
                    f"module.requires_grad_(False)"
                )
