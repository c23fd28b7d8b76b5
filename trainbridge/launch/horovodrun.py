"""horovodrun in Gloo mode (``horovodrun --gloo``, the default without MPI).

horovodrun starts each worker itself and exports HOROVOD_RANK, HOROVOD_SIZE,
HOROVOD_LOCAL_RANK, HOROVOD_LOCAL_SIZE, HOROVOD_CROSS_RANK and the address of its
rendezvous key-value server (HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT). In MPI mode it
runs mpirun instead, and :mod:`trainbridge.launch.mpi` recognises the workers.
"""

from __future__ import annotations

from typing import Mapping, Optional

from .environment import LaunchEnv, read_int, required_int


def detect(environ: Mapping[str, str]) -> Optional[LaunchEnv]:
    if "HOROVOD_RANK" not in environ or "HOROVOD_SIZE" not in environ:
        return None
    return LaunchEnv(
        launcher="horovodrun",
        rank=required_int(environ, "HOROVOD_RANK"),
        world_size=required_int(environ, "HOROVOD_SIZE"),
        local_rank=read_int(environ, "HOROVOD_LOCAL_RANK", default=0),
        local_size=read_int(environ, "HOROVOD_LOCAL_SIZE", default=1),
        node_rank=read_int(environ, "HOROVOD_CROSS_RANK", default=0),
    )
