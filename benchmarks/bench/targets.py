"""The speed targets, each a ratio of two configurations measured in the same run.

``ratio = metric of config / (metric of reference x scale)``, where scale is the
config's process count for the scaling targets and 1 otherwise. The metric is
samples/s (higher is better; met at or above the threshold) or the end-to-end
wall time from launch to exit (lower is better; met at or below). A reference
given as several configurations is the best of them: the peer targets compare
trainbridge with whichever of the DDP tutorial, Accelerate and Fabric did best.
Ratios use the medians over repeats; ``ratio_per_repeat`` pairs the runs of each
repeat (adjacent in time), which shows how much the machine's noise moves the ratio.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Dict, List, Optional, Tuple, Union

from .configs import PEERS

UNIT = "local_1_thread"  # the per-core unit that scaling efficiency is measured against


@dataclasses.dataclass(frozen=True)
class Target:
    id: str
    name: str
    config: str
    reference: Union[str, Tuple[str, ...]]  # several: the best of them
    threshold: Optional[float]  # None: a reference figure that explains the targets, not a target
    scale_by_nproc: bool = False
    metric: str = "samples_per_second"  # or "wall_seconds"

    @property
    def lower_is_better(self) -> bool:
        return self.metric == "wall_seconds"


TARGETS = [
    Target("T1", "torch backend vs hand-written DDP", "torch_gloo", "ddp_tutorial", 1.10),
    Target("T2a", "horovod backend vs hand-written Horovod (gloo)", "horovod_gloo", "horovod_tutorial_gloo", 1.10),
    Target("T2b", "horovod backend vs hand-written Horovod (mpi)", "horovod_mpi", "horovod_tutorial_mpi", 1.10),
    Target("T3a", "torch/gloo, N processes vs N x one-thread unit", "torch_gloo", UNIT, 0.90, scale_by_nproc=True),
    Target("T3b", "horovod/gloo, N processes vs N x one-thread unit", "horovod_gloo", UNIT, 0.90, scale_by_nproc=True),
    Target("T3c", "horovod/mpi, N processes vs N x one-thread unit", "horovod_mpi", UNIT, 0.90, scale_by_nproc=True),
    Target("T4", "trainbridge, 1 process vs bare loop", "local_all_cores", "bare_loop", 0.98),
    Target(
        "R3",
        "ceiling for T3: N bare loops without communication vs N x one-thread unit",
        "independent_bare_loops",
        UNIT,
        None,
        scale_by_nproc=True,
    ),
    Target("R1", "torch backend with --amp bf16 vs hand-written DDP (fp32)", "torch_gloo_bf16", "ddp_tutorial", None),
    Target(
        "R2",
        "torch backend, shared-memory gradient exchange vs gloo (--shm-allreduce off)",
        "torch_gloo",
        "torch_gloo_no_shm",
        None,
    ),
    Target(
        "P1",
        "trainbridge train, end-to-end wall time vs the best peer",
        "torch_gloo",
        PEERS,
        0.90,
        metric="wall_seconds",
    ),
    Target("P2", "trainbridge train, steady-state samples/s vs the best peer", "torch_gloo", PEERS, 0.95),
    Target(
        "P3",
        "trainbridge API loop, end-to-end wall time vs the best peer",
        "trainbridge_loop",
        PEERS,
        0.90,
        metric="wall_seconds",
    ),
    Target("P4", "trainbridge API loop, steady-state samples/s vs the best peer", "trainbridge_loop", PEERS, 0.95),
]


def values_by_repeat(summary: Dict[str, Any], metric: str) -> Dict[int, float]:
    return {r["repeat"]: r[metric] for r in summary["runs"] if r["status"] == "ok" and r[metric]}


def best(values: List[float], lower_is_better: bool) -> float:
    return min(values) if lower_is_better else max(values)


def evaluate(target: Target, configs: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """The target's measured ratio and whether it is met (None when either side has no figure)."""
    names = (target.reference,) if isinstance(target.reference, str) else target.reference
    mine, refs = configs.get(target.config), [configs[n] for n in names if configs.get(n, {}).get(target.metric)]
    row: Dict[str, Any] = {**dataclasses.asdict(target), "ratio": None, "met": None, "ratio_per_repeat": []}
    if not mine or not refs or not mine[target.metric]:
        return row
    ref = best([r[target.metric] for r in refs], target.lower_is_better)
    row["best_reference"] = next(n for n in names if configs.get(n, {}).get(target.metric) == ref)
    scale = mine["nproc"] if target.scale_by_nproc else 1
    row["scale"] = scale
    row["ratio"] = mine[target.metric] / (ref * scale)
    if target.threshold is not None:
        row["met"] = (
            (row["ratio"] <= target.threshold) if target.lower_is_better else (row["ratio"] >= target.threshold)
        )
    a = values_by_repeat(mine, target.metric)
    b = [values_by_repeat(r, target.metric) for r in refs]
    row["ratio_per_repeat"] = [
        round(a[k] / (best([v[k] for v in b], target.lower_is_better) * scale), 4)
        for k in sorted(a)
        if all(k in v for v in b)
    ]
    return row


def evaluate_all(configs: Dict[str, Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [evaluate(t, configs) for t in TARGETS]


def scaling_efficiency(summary: Dict[str, Any], unit_rate: Optional[float]) -> Optional[float]:
    """Throughput over (cores used x the one-thread unit): 1.0 is perfect use of every core."""
    if not unit_rate or not summary["samples_per_second"]:
        return None
    return summary["samples_per_second"] / (summary["cores_used"] * unit_rate)


def ratio_spread(row: Dict[str, Any]) -> Optional[str]:
    values = row.get("ratio_per_repeat") or []
    if len(values) < 2:
        return None
    return f"{min(values):.2f}-{max(values):.2f} (median {statistics.median(values):.2f})"
