"""The kernels behind --optimizer: torch's fused implementation wherever it has one.

On CPUs torch's Adam and SGD default to a loop over the parameters, one kernel
(and one pass over memory) per tensor and per term of the update; their fused
kernels update every parameter in one vectorized pass. ResNet34's Adam step on
one core: 108 ms looped, 28 ms fused. The update rule is the same: after one
step the weights differ from the loop's by about one float32 rounding (1.5e-8),
and every backend and launcher uses the same kernel, so runs still agree with
each other. Adadelta has no fused kernel and keeps torch's default.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

FUSED_OPTIMIZERS = ("adam", "sgd")
FUSED_DEVICES = ("cpu", "cuda")


def fused_kernels(optimizer: str, device: torch.device) -> Dict[str, Any]:
    """Keyword arguments for torch's constructor of ``optimizer`` (a --optimizer name) on ``device``."""
    return {"fused": True} if optimizer in FUSED_OPTIMIZERS and device.type in FUSED_DEVICES else {}


KERNEL_FLAGS = ("fused", "foreach")


def load_keeping_kernels(optimizer: torch.optim.Optimizer, state: Dict) -> None:
    """``optimizer.load_state_dict(state)``, keeping the kernels this run's optimizer was built with.

    A checkpoint's param_groups carry the kernel flags of the run that wrote it:
    ``fused: None`` when written before fused kernels were trainbridge's default, or
    flags meant for another device. Loaded as they are, they would silently put the
    resumed run on the looped kernel (4x slower for ResNet34's Adam on a CPU).
    The flags are replaced before loading, so that torch places the restored step
    counters where this kernel needs them (on the parameters' device when fused).
    """
    saved = state["param_groups"]
    if len(saved) == len(optimizer.param_groups):  # else let torch name the mismatch
        saved = [
            {**group, **{flag: mine[flag] for flag in KERNEL_FLAGS if flag in mine}}
            for group, mine in zip(saved, optimizer.param_groups)
        ]
    optimizer.load_state_dict({**state, "param_groups": saved})
