"""SLURM ``srun`` job steps.

srun exports SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID and, for a
step, SLURM_STEP_ID. A bare ``sbatch`` script has SLURM_JOB_ID but no step
tasks, so it is *not* treated as a multi-process launch. The rendezvous address
is MASTER_ADDR when set, else the first host of the step's node list.
"""

from __future__ import annotations

import re
from typing import Mapping, Optional

from .environment import LaunchEnv, read_int, required_int

DEFAULT_PORT = 29500


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``"gpu[03-05,9],cpu1"`` -> ``"gpu03"``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def tasks_on_first_node(tasks_per_node: str) -> int:
    """Tasks on the first node from SLURM's compact form: ``"2(x3),1"`` -> 2."""
    match = re.match(r"\d+", tasks_per_node.strip())
    return int(match.group(0)) if match else 1


def detect(environ: Mapping[str, str]) -> Optional[LaunchEnv]:
    if "SLURM_PROCID" not in environ or "SLURM_STEP_ID" not in environ:
        return None
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or "localhost"
    job_id = read_int(environ, "SLURM_JOB_ID", default=0)
    return LaunchEnv(
        launcher="srun",
        rank=required_int(environ, "SLURM_PROCID"),
        world_size=read_int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", default=1),
        local_rank=read_int(environ, "SLURM_LOCALID", default=0),
        local_size=tasks_on_first_node(
            environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_NTASKS_PER_NODE") or "1"
        ),
        node_rank=read_int(environ, "SLURM_NODEID", default=0),
        master_addr=environ.get("MASTER_ADDR") or first_host(nodelist),
        # A port derived from the job id keeps concurrent jobs on one node apart.
        master_port=read_int(environ, "MASTER_PORT", default=DEFAULT_PORT + job_id % 1000),
    )
