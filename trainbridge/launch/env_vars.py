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
from .environment import LaunchEnv, read_int, read_port, required_int

REQUIRED = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")


class RankOutsideWorld(UserError):
    """RANK and WORLD_SIZE that give this process no place in the job (its peers would wait for ever)."""


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
    rank, world_size = required_int(environ, "RANK"), required_int(environ, "WORLD_SIZE")
    if world_size < 1 or not 0 <= rank < world_size:  # set by hand: the one launcher that can get them wrong
        raise RankOutsideWorld(
            f"RANK={rank} with WORLD_SIZE={world_size}: "
            + ("WORLD_SIZE must be at least 1" if world_size < 1 else f"RANK must be 0 to {world_size - 1}")
            + "; give the job's processes RANK 0, 1, ... WORLD_SIZE-1, one each"
        )
    return LaunchEnv(
        launcher="env",
        rank=rank,
        world_size=world_size,
        local_rank=read_int(environ, "LOCAL_RANK", default=0),
        local_size=read_int(environ, "LOCAL_WORLD_SIZE", default=1),
        node_rank=read_int(environ, "GROUP_RANK", "NODE_RANK", default=0),
        master_addr=environ["MASTER_ADDR"],
        master_port=read_port(environ, "MASTER_PORT"),
    )
