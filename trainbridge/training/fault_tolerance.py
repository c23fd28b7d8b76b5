"""How ``trainbridge train`` ends early: preemption (exit 143) and fault injection (``--fail-at-step``).

A NaN or infinite loss ends it too: :mod:`trainbridge.training.loss_check`.

The stop agreement itself (SIGTERM on any rank -> every rank stops at the same
step) and the watchdog are the public API's: :mod:`trainbridge.api.stop`.
"""

from __future__ import annotations

import os
from typing import Optional

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
