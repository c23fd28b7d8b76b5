"""The instrument shared by trainbridge runs and the baselines, so both are timed the same way.

A run's result is the ``"event": "final"`` line of ``DIR/metrics.jsonl``, with
the keys trainbridge's loop writes: ``samples_per_second`` (summed over ranks,
after warm-up), ``step_time_median`` and ``step_time_p90`` (seconds, rank 0) and
``peak_rss_mb_per_rank``, and, where the run evaluates, ``first_step_at`` (Unix
time at the end of rank 0's first step: the bench subtracts its launch time) and
``val_samples`` (how many validation samples the run's own metric code counted,
over all ranks). Steps are timed by :class:`trainbridge.training.metrics.StepTimer`:
the gap between consecutive optimizer steps, warm-up and each epoch's first step
left out.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List

from trainbridge.training.metrics import MetricsLog, StepTimer, peak_rss_mb

__all__ = ["StepTimer", "rank_performance", "write_final", "read_final", "leave"]


def leave() -> None:
    """End a baseline after its own teardown, without the interpreter's C++ teardown, as ``job.exit`` does.

    With torch's gloo, destroying the DDP reducer's process group at interpreter
    exit sometimes aborts the process or deadlocks (a gloo thread waits for the
    GIL that the destructor holds): seen with Fabric and Accelerate on 3 ranks.
    Every row ends the same way, so that none fails or hangs for that reason.
    """
    from trainbridge.api import exit_process

    exit_process(0)


def rank_performance(timer: StepTimer) -> Dict[str, Any]:
    """This rank's throughput, step times and peak RSS; gather these from every rank."""
    timing = timer.summary()
    return {
        "sps": timing["local_samples_per_second"],
        "step_time_median": timing["step_time_median"],
        "step_time_p90": timing["step_time_p90"],
        "first_step_at": timer.first_step_at,
        "rss": peak_rss_mb(),
    }


def write_final(output_dir: str, per_rank: List[Dict[str, Any]], **extra: Any) -> None:
    """Write the ``final`` line from every rank's :func:`rank_performance`, in rank order (main rank only)."""
    rates = [r["sps"] for r in per_rank]
    MetricsLog(output_dir, enabled=True).write(
        {
            "event": "final",
            **extra,
            "samples_per_second": sum(rates) if None not in rates else None,
            "step_time_median": per_rank[0]["step_time_median"],
            "step_time_p90": per_rank[0]["step_time_p90"],
            "first_step_at": per_rank[0]["first_step_at"],
            "peak_rss_mb_per_rank": [round(r["rss"], 1) for r in per_rank],
        }
    )


def read_final(output_dir: str) -> Dict[str, Any]:
    """The last ``final`` line of ``DIR/metrics.jsonl``; empty when there is none."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    finals = [r for r in rows if r.get("event") == "final"]
    return finals[-1] if finals else {}
