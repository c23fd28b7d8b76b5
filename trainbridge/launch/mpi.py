"""mpirun / mpiexec: Open MPI (OMPI_COMM_WORLD_*) and MPICH or Intel MPI (PMI_*).

This also covers ``horovodrun --mpi``, which runs mpirun underneath. MPI gives no
rendezvous address for torch.distributed; the torch backend agrees on one
through mpi4py (see :mod:`trainbridge.launch.rendezvous`).
"""

from __future__ import annotations

from typing import Mapping, Optional

from .environment import LaunchEnv, read_int, required_int


def detect(environ: Mapping[str, str]) -> Optional[LaunchEnv]:
    if "OMPI_COMM_WORLD_SIZE" in environ:
        world_size = required_int(environ, "OMPI_COMM_WORLD_SIZE")
        local_size = read_int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", default=1)
        return LaunchEnv(
            launcher="mpirun",
            rank=required_int(environ, "OMPI_COMM_WORLD_RANK"),
            world_size=world_size,
            local_rank=read_int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", default=0),
            local_size=local_size,
            node_rank=read_int(environ, "OMPI_COMM_WORLD_NODE_RANK", default=0),
        )
    if "PMI_SIZE" in environ and "PMI_RANK" in environ:
        return LaunchEnv(
            launcher="mpirun",
            rank=required_int(environ, "PMI_RANK"),
            world_size=required_int(environ, "PMI_SIZE"),
            local_rank=read_int(environ, "MPI_LOCALRANKID", "PMI_LOCAL_RANK", default=0),
            local_size=read_int(environ, "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE", default=1),
        )
    return None
