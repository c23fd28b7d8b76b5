"""The check that stops ``trainbridge train`` at the first NaN or infinite training loss."""

from __future__ import annotations

from typing import Callable

import torch

from ..api import Job
from ..errors import UserError


class NonFiniteLossCheck:
    """Stops the run at the first non-finite training loss, before any checkpoint holds its weights.

    The first bad step is kept on the device (no host sync per step); :meth:`check`
    reads it on every rank, so all stop together, before every checkpoint write and
    whenever the loss is read anyway.
    """

    NEVER = 2**40  # larger than any step

    def __init__(self, job: Job) -> None:
        self.job = job
        self.first = torch.full((), self.NEVER, dtype=torch.float64, device=job.device)

    def record(self, loss: torch.Tensor, step: int) -> None:
        bad = ~torch.isfinite(loss.detach())
        self.first = torch.where(bad, torch.clamp(self.first, max=step), self.first)

    def check(self, hint: Callable[[], str]) -> None:
        """Every rank calls it: raise UserError naming the first step with a NaN/inf loss on any rank."""
        first = int(-self.job.allreduce(-self.first, "max").item())  # the minimum over ranks
        if first < self.NEVER:
            raise UserError(
                f"the training loss became NaN or infinite at step {first}; nothing from that step on "
                f"was saved; {hint()}",
                quiet=not self.job.is_main,
            )
