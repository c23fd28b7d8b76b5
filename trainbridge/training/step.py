"""One optimizer step of ``trainbridge train``: micro-batches (--accumulate), mixed precision (--amp).

The loop hands over one step's batch (``accumulate x batch size`` samples per
rank) and gets back its mean loss, still on the device so that no step waits for
a host sync. Written on the public API: where DDP and Horovod differ (skipping the
allreduce of early micro-batches, stepping with a GradScaler), the job's
``no_sync``, ``backward`` and ``step`` decide.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..api import Job
from ..tasks import Task
from ..tasks.checks import check_loss


def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def cpu_bf16_warning(amp: str, device: torch.device) -> Optional[str]:
    """bf16 autocast on a CPU without AVX512-BF16 or AMX converts to and from fp32 around its kernels.

    Allowed, but said: the warning line, or None where there is nothing to say.
    """
    if amp != "bf16" or device.type != "cpu" or cpu_has_bf16():
        return None
    return (
        f"[trainbridge] warning: this CPU ({torch.backends.cpu.get_cpu_capability()}) has no bfloat16 "
        f"instructions (AVX512-BF16 or AMX), so --amp bf16 is usually slower than fp32 here, not faster; "
        f"use --amp off"
    )


def memory_format(channels_last: str, device: torch.device) -> torch.memory_format:
    """--channels-last: NHWC lets cuDNN use tensor-core convolutions without transposes (auto: on GPUs)."""
    on = channels_last == "on" or (channels_last == "auto" and device.type == "cuda")
    return torch.channels_last if on else torch.contiguous_format


class TrainStep:
    def __init__(
        self,
        task: Task,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        job: Job,
        micro_batch_size: int,
        layout: torch.memory_format = torch.contiguous_format,
        compile: bool = False,
    ) -> None:
        self.task, self.model, self.optimizer, self.job = task, model, optimizer, job
        # Compiled once per process, after the backend wrapped the model: DDP's
        # compiled graph is split at bucket boundaries, so allreduces still overlap
        # the backward pass. no_sync() acts on the wrapper, not the compiled view.
        self.forward = torch.compile(model) if compile else model
        self.layout = layout
        self.micro_batch_size = micro_batch_size

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward and backward every micro-batch, then one optimizer step; returns the batch's mean loss."""
        if images.dim() == 4 and self.layout != torch.contiguous_format:
            images = images.contiguous(memory_format=self.layout)
        micro = list(zip(images.split(self.micro_batch_size), labels.split(self.micro_batch_size)))
        self.optimizer.zero_grad()  # set_to_none by default
        total = torch.zeros((), device=images.device)
        for i, (x, y) in enumerate(micro):
            # Gradients of the early micro-batches only accumulate locally; the
            # last backward averages the sum over ranks (DDP no_sync, Horovod
            # backward_passes_per_step), so a step costs one allreduce, not K.
            with self.job.no_sync(self.model, enabled=i < len(micro) - 1):
                with self.job.autocast():
                    loss = self.task.loss(self.forward(x), y)
                check_loss(self.task, loss, "mean", quiet=not self.job.is_main)  # backward needs one number
                if len(micro) > 1:
                    # Weighted by size, the micro-batch losses sum to the mean over
                    # the whole batch: K micro-batches of B match one batch of K*B.
                    loss = loss * (len(y) / len(labels))
                self.job.backward(loss)
            total += loss.detach().float()
        self.job.step(self.optimizer)
        return total
