"""The speed targets of issue 6, each a ratio of two configurations measured in the same run.

``ratio = samples/s of config / (samples/s of reference x scale)``, where scale is
the config's process count for the scaling targets and 1 otherwise. Ratios use
the medians over repeats; ``ratio_per_repeat`` pairs the two runs of each repeat
(adjacent in time), which shows how much the machine's noise moves the ratio.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Dict, List, Optional

UNIT = "local_1_thread"  # the per-core unit that scaling efficiency is measured against


@dataclasses.dataclass(frozen=True)
class Target:
    id: str
    name: str
    config: str
    reference: str
    threshold: Optional[float]  # None: a reference figure that explains the targets, not a target
    scale_by_nproc: bool = False


TARGETS = [
    Target("T1", "torch backend vs hand-written DDP", "torch_gloo", "ddp_tutorial", 1.10),
    Target("T2a", "horovod backend vs hand-written Horovod (gloo)", "horovod_gloo", "horovod_tutorial_gloo", 1.10),
    Target("T2b", "horovod backend vs hand-written Horovod (mpi)", "horovod_mpi", "horovod_tutorial_mpi", 1.10),
    Target("T3a", "torch/gloo, N processes vs N x one-thread unit", "torch_gloo", UNIT, 0.90, scale_by_nproc=True),
    Target("T3b", "horovod/gloo, N processes vs N x one-thread unit", "horovod_gloo", UNIT, 0.90, scale_by_nproc=True),
    Target("T3c", "horovod/mpi, N processes vs N x one-thread unit", "horovod_mpi", UNIT, 0.90, scale_by_nproc=True),
    Target("T4", "trainbridge, 1 process vs bare loop", "local_all_cores", "bare_loop", 0.98),
    Target("R3", "ceiling for T3: N bare loops without communication vs N x one-thread unit",
           "independent_bare_loops", UNIT, None, scale_by_nproc=True),
    Target("R1", "torch backend with --amp bf16 vs hand-written DDP (fp32)", "torch_gloo_bf16", "ddp_tutorial", None),
    Target("R2", "torch backend, shared-memory gradient exchange vs gloo (--shm-allreduce off)", "torch_gloo",
           "torch_gloo_no_shm", None),
]


def rates_by_repeat(summary: Dict[str, Any]) -> Dict[int, float]:
    return {r["repeat"]: r["samples_per_second"] for r in summary["runs"] if r["status"] == "ok"}


def evaluate(target: Target, configs: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """The target's measured ratio and whether it is met (None when either side has no figure)."""
    mine, ref = configs.get(target.config), configs.get(target.reference)
    row: Dict[str, Any] = {**dataclasses.asdict(target), "ratio": None, "met": None, "ratio_per_repeat": []}
    if not mine or not ref or not mine["samples_per_second"] or not ref["samples_per_second"]:
        return row
    scale = mine["nproc"] if target.scale_by_nproc else 1
    row["scale"] = scale
    row["ratio"] = mine["samples_per_second"] / (ref["samples_per_second"] * scale)
    row["met"] = None if target.threshold is None else row["ratio"] >= target.threshold
    a, b = rates_by_repeat(mine), rates_by_repeat(ref)
    row["ratio_per_repeat"] = [round(a[k] / (b[k] * scale), 4) for k in sorted(a) if k in b]
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
