"""Cheap invariant checks across ranks, run once per epoch.

Data-parallel training is only correct while every rank applies the same
update. Gradients are averaged by the backend, but a learning-rate scheduler
runs on each rank: one stepped with a rank-local metric (e.g. each shard's own
validation loss) takes different decisions on different ranks, and the models
drift apart silently. Checking is one small allgather per epoch.
"""

from __future__ import annotations

from typing import List

import torch

from ..api import Job


class RankDivergence(RuntimeError):
    """Ranks disagree on something that must be identical: a bug, not a user error."""


def learning_rates_per_rank(optimizer: torch.optim.Optimizer, job: Job) -> List[float]:
    """Every rank's learning rate (of the first parameter group), in rank order; raises if they differ.

    Collective: every rank must call it at the same point.
    """
    mine = [group["lr"] for group in optimizer.param_groups]
    everyone = job.allgather_object(mine)
    if any(theirs != everyone[0] for theirs in everyone):
        listing = ", ".join(f"rank {r}: {lrs}" for r, lrs in enumerate(everyone))
        raise RankDivergence(
            f"learning rates differ between ranks ({listing}); every rank must step the "
            f"scheduler with the same, globally reduced, metric"
        )
    return [lrs[0] for lrs in everyone]
