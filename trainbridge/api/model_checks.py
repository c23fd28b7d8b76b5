"""Mistakes in a model and its optimizers that PyTorch accepts silently, refused by ``job.prepare`` in one line."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

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


def check_something_to_train(model: torch.nn.Module, quiet: bool = False) -> None:
    """Refuse a model with no parameter that requires a gradient: nothing to average (DDP refuses it too)."""
    parameters = list(model.parameters())
    if not any(p.requires_grad for p in parameters):
        held = f"all {len(parameters)} of its parameters are frozen" if parameters else "it has no parameters"
        raise UserError(
            f"job.prepare: the model has nothing to train ({held}), so there are no gradients to average; "
            f"unfreeze what should train (requires_grad_(True)) before job.prepare, or, to evaluate it only, "
            f"move it with model.to(job.device) instead",
            quiet=quiet,
        )


def check_optimizers(
    model: torch.nn.Module, given: Sequence[Any], earlier: Sequence[torch.optim.Optimizer]
) -> List[torch.optim.Optimizer]:
    """The optimizers among ``given`` (``job.prepare``'s arguments after the model, None for none), in order.

    Refuses what is not an optimizer (a loader, a scheduler), an optimizer given twice, and a
    parameter held by two optimizers, of this call or of ``earlier`` ones (those of models
    prepared before): each step would update it twice. A parameter of another model is allowed.
    """
    numbered = [(n, o) for n, o in enumerate(given, start=1) if o is not None]
    for n, optimizer in numbered:
        if not (hasattr(optimizer, "param_groups") and callable(getattr(optimizer, "step", None))):
            raise UserError(
                f"job.prepare(model, *optimizers): optimizer {n} is a {type(optimizer).__name__}, not an "
                f"optimizer; pass the model and its optimizers only (build loaders with job.train_loader and "
                f"schedulers after job.prepare)"
            )
    names = {p: repr(name) for name, p in model.named_parameters()}
    holders: Dict[torch.nn.Parameter, str] = {}
    for optimizer in earlier:
        if all(optimizer is not o for _, o in numbered):  # the same optimizer may serve two prepared models
            holders.update((p, "an optimizer given to an earlier job.prepare") for p in parameters_of(optimizer))
    for n, optimizer in numbered:
        this = f"optimizer {n}"
        for p in parameters_of(optimizer):
            if p in holders:
                raise UserError(
                    f"job.prepare: the parameter {names.get(p, f'of shape {tuple(p.shape)}')} is in {holders[p]} "
                    f"and in {this}, so each step would update it twice; give each parameter to one optimizer "
                    f"(e.g. SparseAdam over the sparse embeddings, Adam over the other parameters)"
                )
        holders.update((p, this) for p in parameters_of(optimizer))
    return [o for _, o in numbered]


def parameters_of(optimizer: torch.optim.Optimizer) -> List[torch.nn.Parameter]:
    """Every parameter ``optimizer`` steps, in its groups' order."""
    return [p for group in optimizer.param_groups for p in group["params"]]
