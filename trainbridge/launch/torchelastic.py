"""torchrun / torch.distributed.elastic, and ``trainbridge.train --nproc N``.

torchrun exports RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT and TORCHELASTIC_RUN_ID. Our own spawner
(:mod:`trainbridge.launch.spawn`) exports the same names plus
``TRAINBRIDGE_SPAWNED=1`` so that it is reported as "spawn".
"""

from __future__ import annotations

import json
import os
import time
from typing import Mapping, Optional

from .environment import LaunchEnv, read_int


def detect(environ: Mapping[str, str]) -> Optional[LaunchEnv]:
    if "TORCHELASTIC_RUN_ID" not in environ and "TRAINBRIDGE_SPAWNED" not in environ:
        return None
    return LaunchEnv(
        launcher="spawn" if "TRAINBRIDGE_SPAWNED" in environ else "torchrun",
        rank=read_int(environ, "RANK", default=0),
        world_size=read_int(environ, "WORLD_SIZE", default=1),
        local_rank=read_int(environ, "LOCAL_RANK", default=0),
        local_size=read_int(environ, "LOCAL_WORLD_SIZE", default=1),
        node_rank=read_int(environ, "GROUP_RANK", "NODE_RANK", default=0),
        master_addr=environ.get("MASTER_ADDR"),
        master_port=read_int(environ, "MASTER_PORT"),
    )


def record_error(message: str, environ: Mapping[str, str] = os.environ) -> None:
    """Hand a worker's one-line error to torchrun, which shows it in its failure summary.

    torchrun reads TORCHELASTIC_ERROR_FILE in the format of
    ``torch.distributed.elastic.multiprocessing.errors.record``.
    """
    path = environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump(
                {
                    "message": {
                        "message": message,
                        "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))},
                    }
                },
                f,
            )
