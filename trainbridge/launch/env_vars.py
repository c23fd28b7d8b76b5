"""The plain ``env://`` contract: WORLD_SIZE, RANK, MASTER_ADDR and MASTER_PORT set by hand.

Kubeflow's PyTorchJob, many cluster wrappers and hand-written launch scripts
start each process this way, without torchrun. Missed, every process would run
alone as a one-process job and train its own model. LOCAL_RANK and
LOCAL_WORLD_SIZE are read when given; otherwise each process is taken to be
alone on its host (one process per pod or node).
"""

from __future__ import annotations

from typing import Mapping, Optional

from ..errors import UserError
from .environment import LaunchEnv, read_int, required_int

REQUIRED = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")


def detect(environ: Mapping[str, str]) -> Optional[LaunchEnv]:
    missing = [name for name in REQUIRED if not environ.get(name)]
    if missing and (read_int(environ, "WORLD_SIZE", default=1) or 1) > 1:
        # Half of the contract: each process would otherwise run alone and train its own model.
        raise UserError(
            f"WORLD_SIZE={environ['WORLD_SIZE']} is set but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not: set all of {', '.join(REQUIRED)} for env:// "
            f"(or start with torchrun, mpirun, horovodrun or srun), or unset WORLD_SIZE for one process"
        )
    if missing:
        return None
    return LaunchEnv(
        launcher="env",
        rank=required_int(environ, "RANK"),
        world_size=required_int(environ, "WORLD_SIZE"),
        local_rank=read_int(environ, "LOCAL_RANK", default=0),
        local_size=read_int(environ, "LOCAL_WORLD_SIZE", default=1),
        node_rank=read_int(environ, "GROUP_RANK", "NODE_RANK", default=0),
        master_addr=environ["MASTER_ADDR"],
        master_port=read_int(environ, "MASTER_PORT"),
    )
