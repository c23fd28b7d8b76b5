"""What ``trainbridge train`` checks of a task's answers, each refusal one line that names the fix.

Pure functions of what a task returned, so the loop can check before it trains:
the model (:func:`check_model`), the splits (:func:`check_splits`), a loss
(:func:`check_loss`) and a batch's metrics (:func:`metric_sums`). A Python number
is a fine metric sum; a list or a per-sample tensor is not. Every rank checks the
same task alike: ``quiet=True`` off the main rank leaves the one line to rank 0.
"""

from __future__ import annotations

import numbers
from typing import Any, Dict, Optional

import torch

from ..errors import UserError
from .base import Task

METRIC_EXAMPLE = '{"accuracy": (outputs.argmax(1) == targets).sum()}'


def describe(value: Any) -> str:
    """``value``'s kind in a few words: "None", "a list of 8 values", "a tensor of shape (8,)", "a str"."""
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} values"
    return f"a {type(value).__name__}"


def check_model(task: Task, model: Any, quiet: bool = False) -> torch.nn.Module:
    """``model`` if ``build_model`` returned a ``torch.nn.Module``; else one line."""
    if not isinstance(model, torch.nn.Module):
        hint = " (a missing return?)" if model is None else ""
        raise UserError(
            f"{type(task).__name__}.build_model returned {describe(model)}{hint}, not a torch.nn.Module; "
            f"return the model itself",
            quiet=quiet,
        )
    return model


def check_splits(task: Task, scheduler: Optional[str], quiet: bool = False) -> None:
    """A validation split is None (train without evaluating) or has samples; the plateau scheduler needs one."""
    name = type(task).__name__
    val = task.eval_dataset("val")
    if val is None and scheduler == "plateau":
        raise UserError(
            f"--scheduler plateau steps on the validation loss, but {name}.eval_dataset('val') is None; "
            f"use --scheduler step, or give the task a validation split",
            quiet=quiet,
        )
    if val is not None and hasattr(val, "__len__") and len(val) == 0:
        raise UserError(
            f"{name}.eval_dataset('val') has no samples, so no epoch could be evaluated; give it "
            f"samples, or return None to train without validation",
            quiet=quiet,
        )


def check_loss(task: Task, loss: Any, reduction: str, quiet: bool = False) -> None:
    """A loss is one number, as a tensor (the training loss is differentiated)."""
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        raise UserError(
            f"{type(task).__name__}.loss(..., reduction={reduction!r}) returned {describe(loss)}, not one "
            f"number; return a tensor reduced over the batch as reduction asks "
            f"(mean for training, sum for evaluation)",
            quiet=quiet,
        )


def metric_sums(task: Task, metrics: Any, quiet: bool = False) -> Dict[str, torch.Tensor]:
    """A batch's metrics as float64 tensors: each one number (a tensor of one element or a Python number)."""
    name = type(task).__name__
    if not isinstance(metrics, dict):
        raise UserError(
            f"{name}.metrics returned {describe(metrics)}; return a dict of per-batch sums, "
            f"e.g. {METRIC_EXAMPLE} ({{}} for none)",
            quiet=quiet,
        )
    sums = {}
    for key, value in metrics.items():
        one_number = (isinstance(value, numbers.Number) and not isinstance(value, complex)) or (
            isinstance(value, torch.Tensor) and value.numel() == 1
        )
        if not one_number:
            raise UserError(
                f"{name}.metrics: {key!r} is {describe(value)}; give each metric as one number per "
                f"batch, the sum over its samples, e.g. {METRIC_EXAMPLE}",
                quiet=quiet,
            )
        sums[key] = torch.as_tensor(value).detach().double().reshape(())
    return sums
