"""One optimizer step: micro-batches (--accumulate), mixed precision (--amp) and the backend's update.

The loop hands over one step's batch (``accumulate x batch size`` samples per
rank) and gets back its mean loss, still on the device so that no step waits for
a host sync. Everything here is written once for every backend: where DDP and
Horovod differ (skipping the allreduce of early micro-batches, stepping with a
GradScaler), the backend's ``no_sync`` and ``step`` decide.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ..backends import Backend
from ..errors import UserError
from ..tasks import Task

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_amp(amp: str, device: torch.device) -> None:
    """fp16 without a GPU is slow (no fp16 kernels), but it runs and exercises the GradScaler: allowed."""
    if amp != "off" and amp not in AMP_DTYPES:
        raise UserError(f"--amp {amp} is not supported; use off, bf16 or fp16")
    if amp == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError("--amp bf16 needs a GPU with bfloat16 support (Ampere or newer); use --amp fp16 here")


def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def cpu_bf16_warning(amp: str, device: torch.device) -> Optional[str]:
    """bf16 autocast on a CPU without AVX512-BF16 or AMX converts to and from fp32 around its kernels: allowed, but said."""
    if amp != "bf16" or device.type != "cpu" or cpu_has_bf16():
        return None
    return (f"[trainbridge] warning: this CPU ({torch.backends.cpu.get_cpu_capability()}) has no bfloat16 "
            f"instructions (AVX512-BF16 or AMX), so --amp bf16 is usually slower than fp32 here, not faster; "
            f"use --amp off")


def make_scaler(amp: str, device: torch.device) -> Optional[torch.amp.GradScaler]:
    """fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none."""
    return torch.amp.GradScaler(device.type) if amp == "fp16" else None


def memory_format(channels_last: str, device: torch.device) -> torch.memory_format:
    """--channels-last: NHWC lets cuDNN use tensor-core convolutions without transposes (auto: on GPUs)."""
    on = channels_last == "on" or (channels_last == "auto" and device.type == "cuda")
    return torch.channels_last if on else torch.contiguous_format


class TrainStep:
    def __init__(self, task: Task, model: torch.nn.Module, optimizer: torch.optim.Optimizer, backend: Backend,
                 micro_batch_size: int, amp: str = "off", scaler: Optional[torch.amp.GradScaler] = None,
                 layout: torch.memory_format = torch.contiguous_format, compile: bool = False) -> None:
        self.task, self.model, self.optimizer, self.backend = task, model, optimizer, backend
        # Compiled once per process, after the backend wrapped the model: DDP's
        # compiled graph is split at bucket boundaries, so allreduces still overlap
        # the backward pass. no_sync() acts on the wrapper, not the compiled view.
        self.forward = torch.compile(model) if compile else model
        self.layout = layout
        self.micro_batch_size = micro_batch_size
        self.amp_dtype = AMP_DTYPES.get(amp)
        self.scaler = scaler

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.backend.device.type, dtype=self.amp_dtype)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward and backward every micro-batch, then one optimizer step; returns the batch's mean loss."""
        if images.dim() == 4 and self.layout != torch.contiguous_format:
            images = images.contiguous(memory_format=self.layout)
        micro = list(zip(images.split(self.micro_batch_size), labels.split(self.micro_batch_size)))
        self.optimizer.zero_grad()  # set_to_none by default
        total = torch.zeros((), device=images.device)
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            # Gradients of the early micro-batches only accumulate locally; the
            # last backward averages the sum over ranks (DDP no_sync, Horovod
            # backward_passes_per_step), so a step costs one allreduce, not K.
            with (contextlib.nullcontext() if last else self.backend.no_sync(self.model)):
                with self.autocast():
                    loss = self.task.loss(self.forward(x), y)
                if len(micro) > 1:
                    # Weighted by size, the micro-batch losses sum to the mean over
                    # the whole batch: K micro-batches of B match one batch of K*B.
                    loss = loss * (len(y) / len(labels))
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            total += loss.detach().float()
        self.backend.step(self.optimizer, self.scaler)
        return total
