"""Agreeing on a torch.distributed rendezvous address under launchers that give none.

torchrun and srun export MASTER_ADDR/MASTER_PORT. mpirun and horovodrun do not,
so rank 0 picks an address and a free port and shares them over the launcher's
own channel: MPI (mpi4py) under mpirun, horovodrun's rendezvous key-value server
under horovodrun. Plain python with one process binds a local free port.
"""
from __future__ import annotations

import socket
import time
from typing import Tuple

from ..errors import UserError
from .environment import LaunchEnv


def free_port() -> int:
    """A TCP port that was free a moment ago (the store binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def own_address(env: LaunchEnv) -> str:
    """Loopback when the whole job is on this node, else this host's name."""
    return "127.0.0.1" if env.local_size >= env.world_size else socket.getfqdn()


def share_over_mpi(env: LaunchEnv) -> Tuple[str, int]:
    from mpi4py import MPI

    choice = (own_address(env), free_port()) if env.rank == 0 else None
    return MPI.COMM_WORLD.bcast(choice, root=0)


def finalize_mpi() -> None:
    """Finalize MPI if mpi4py started it: mpirun counts a rank that leaves without
    MPI_Finalize as failed, and a process that ends with ``os._exit`` skips
    mpi4py's own atexit finalize."""
    import sys

    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()


def share_over_horovodrun(env: LaunchEnv, environ, timeout: float) -> Tuple[str, int]:
    from horovod.runner.http.http_client import put_data_into_kvstore, read_data_from_kvstore

    server = (environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"], int(environ["HOROVOD_GLOO_RENDEZVOUS_PORT"]))
    scope, key = "trainbridge", "torch_master"
    if env.rank == 0:
        choice = (own_address(env), free_port())
        put_data_into_kvstore(*server, scope, key, choice)
        return choice
    deadline = time.monotonic() + timeout
    while True:
        try:
            return tuple(read_data_from_kvstore(*server, scope, key))
        except RuntimeError:
            if time.monotonic() > deadline:
                raise UserError(f"rank 0 did not publish a torch rendezvous address on horovodrun's server "
                                f"{server[0]}:{server[1]} within {timeout:.0f}s")
            time.sleep(0.1)


def rendezvous_address(env: LaunchEnv, environ=None, timeout: float = 300.0) -> Tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT) that every rank of the job agrees on."""
    import os

    environ = os.environ if environ is None else environ
    if env.master_addr and env.master_port:
        return env.master_addr, env.master_port
    if env.world_size == 1:
        return "127.0.0.1", free_port()
    if env.launcher == "mpirun":
        return share_over_mpi(env)
    if env.launcher == "horovodrun" and "HOROVOD_GLOO_RENDEZVOUS_ADDR" in environ:
        return share_over_horovodrun(env, environ, timeout)
    raise UserError(f"{env.launcher} gave no MASTER_ADDR/MASTER_PORT for torch.distributed; "
                    f"export both on every rank")
