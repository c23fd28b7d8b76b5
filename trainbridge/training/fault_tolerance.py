"""How ``trainbridge train`` ends early: preemption (exit 143), divergence, fault injection (``--fail-at-step``).

The stop agreement itself (SIGTERM on any rank -> every rank stops at the same
step) and the watchdog are the public API's: :mod:`trainbridge.api.stop`.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from ..api import Job
from ..errors import UserError

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM, what schedulers expect from a terminated job
INJECTED_FAILURE_EXIT_CODE = 86


class Preempted(Exception):
    """Raised by the loop after the checkpoint is written; the entry point exits with 143."""


def maybe_fail(fail_at_step: Optional[int], fail_rank: int, rank: int, step: int, output_dir: str) -> None:
    """Exit abruptly (no cleanup, like a crash) on ``fail_rank`` before step ``fail_at_step``, once.

    A marker file in the output directory keeps the restarted run from failing again.
    """
    if fail_at_step is None or step != fail_at_step or rank != fail_rank:
        return
    marker = os.path.join(output_dir, f".failed-at-step-{fail_at_step}")
    if os.path.exists(marker):
        return
    os.makedirs(output_dir, exist_ok=True)
    with open(marker, "w") as f:
        f.write(f"rank {rank} failed on purpose before step {step}\n")
        f.flush()
        os.fsync(f.fileno())
    print(f"[trainbridge] --fail-at-step: rank {rank} exits abruptly before step {step}", flush=True)
    os._exit(INJECTED_FAILURE_EXIT_CODE)


class Divergence:
    """Stops the run at the first non-finite training loss, before any checkpoint holds its weights.

    The first bad step is kept on the device (no host sync per step); :meth:`check`
    reads it on every rank, so all stop together, before every checkpoint write and
    whenever the loss is read anyway.
    """

    NEVER = 2 ** 40  # larger than any step

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
            raise UserError(f"the training loss became NaN or infinite at step {first}; nothing from that step on "
                            f"was saved; {hint()}", quiet=not self.job.is_main)
