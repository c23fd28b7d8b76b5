"""Preemption (SIGTERM) and fault injection (``--fail-at-step``).

SIGTERM, as sent by SLURM before a time limit or by Kubernetes before eviction,
sets a flag. Ranks must agree on the step at which they stop, or one would wait
in a collective for a peer that already left, so the flag is max-allreduced
each step. The allreduce is asynchronous and its result is read one step later:
no host sync, no extra Horovod cycle, and the run stops at most one step after
the signal, with a checkpoint.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Callable, Optional

import torch

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM, what schedulers expect from a terminated job
INJECTED_FAILURE_EXIT_CODE = 86


class Preempted(Exception):
    """Raised by the loop after the checkpoint is written; the entry point exits with 143."""


class StopSignal:
    def __init__(self, allreduce_async: Callable[[torch.Tensor, str], Callable[[], torch.Tensor]]) -> None:
        self.allreduce_async = allreduce_async
        self.received = False
        self.pending: Optional[Callable[[], torch.Tensor]] = None
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        self.received = True

    def agreed(self) -> bool:
        """True on every rank at the same step once any rank got SIGTERM (read one step late)."""
        stop = self.drain()
        self.pending = self.allreduce_async(torch.tensor([1.0 if self.received else 0.0]), "max")
        return stop

    def drain(self) -> bool:
        """Finish the allreduce in flight; whether it said stop."""
        stop = False
        if self.pending is not None:
            stop = bool(self.pending()[0] > 0)
            self.pending = None
        return stop


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
