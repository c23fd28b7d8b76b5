"""Agreeing on a torch.distributed rendezvous address under launchers that give none.

torchrun and srun export MASTER_ADDR/MASTER_PORT. mpirun and horovodrun do not:
MASTER_ADDR/MASTER_PORT exported by the user (``mpirun -x``) are used when set;
otherwise rank 0 picks an address the other hosts can reach (an address, not
its name: see :mod:`trainbridge.launch.network`) and a free port, and shares them
over the launcher's own channel: MPI (mpi4py) under mpirun, horovodrun's
rendezvous key-value server under horovodrun. Plain python with one process
binds a local free port.

:func:`join_process_group` starts torch.distributed's default group on that
address (a TCPStore on rank 0, the world sizes checked first), for callers that
need only the group and not a backend (``trainbridge.hvd``). Across hosts, gloo
is given the interface towards the rendezvous when the host name resolves only
to loopback, and a failed connection is one line with the fix. Every wait here
is bounded by ``timeout``; ``trainbridge.init`` also arms a start-up watchdog.
torch is imported inside the functions that use it, so launcher detection stays light.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from typing import Tuple

from ..errors import UserError, first_line
from ..optional import require
from .environment import LaunchEnv, read_port
from .network import (
    first_external_address,
    gloo_interface_for,
    interface_of,
    is_loopback,
    reachable_address,
    resolve,
    resolves_only_to_loopback,
)


def free_port() -> int:
    """A TCP port that was free a moment ago (the store binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def own_address(env: LaunchEnv, environ=None) -> str:
    """Loopback when the whole job is on this node, else an address of this host the others can reach."""
    environ = os.environ if environ is None else environ
    if env.local_size >= env.world_size:
        return "127.0.0.1"
    interface = (environ.get("GLOO_SOCKET_IFNAME") or environ.get("HOROVOD_GLOO_IFACE") or "").split(",")[0]
    return reachable_address(interface or None)


def share_over_mpi(env: LaunchEnv) -> Tuple[str, int]:
    MPI = require(
        "mpi4py.MPI",
        "torch.distributed under mpirun (rank 0 shares the rendezvous address over MPI)",
        instead="or export MASTER_ADDR and MASTER_PORT to every rank (mpirun -x)",
    )
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
        choice = (own_address(env, environ), free_port())
        put_data_into_kvstore(*server, scope, key, choice)
        return choice
    deadline = time.monotonic() + timeout
    while True:
        try:
            return tuple(read_data_from_kvstore(*server, scope, key))
        except RuntimeError as exc:
            if time.monotonic() > deadline:
                raise UserError(
                    f"rank 0 did not publish a torch rendezvous address on horovodrun's server "
                    f"{server[0]}:{server[1]} within {timeout:.0f}s"
                ) from exc
            time.sleep(0.1)


def rendezvous_address(env: LaunchEnv, environ=None, timeout: float = 300.0) -> Tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT) that every rank of the job agrees on.

    The launcher's own, then MASTER_ADDR/MASTER_PORT exported by the user, then
    one that rank 0 picks and shares over MPI or horovodrun's key-value server.
    """
    environ = os.environ if environ is None else environ
    if env.master_addr and env.master_port:
        return env.master_addr, env.master_port
    if environ.get("MASTER_ADDR") and environ.get("MASTER_PORT"):  # exported by the user (mpirun -x, a wrapper)
        return environ["MASTER_ADDR"], int(read_port(environ, "MASTER_PORT") or 0)
    if env.world_size == 1:
        return "127.0.0.1", free_port()
    if env.launcher == "mpirun":
        return share_over_mpi(env)
    if env.launcher == "horovodrun" and "HOROVOD_GLOO_RENDEZVOUS_ADDR" in environ:
        return share_over_horovodrun(env, environ, timeout)
    raise UserError(f"{env.launcher} gave no MASTER_ADDR/MASTER_PORT for torch.distributed; export both on every rank")


def open_store(env: LaunchEnv, timeout: float, addr: str, port: int):
    """The job's rendezvous store: a TCPStore served by rank 0 at ``addr:port`` (:func:`rendezvous_address`).

    Under torchrun the agent already serves the store on MASTER_PORT; every
    worker is a client, and a prefix per restart keeps attempts apart. Where the
    address is loopback (the whole job on this host: ``--nproc``, ``tb.spawn``, one-host
    mpirun and horovodrun) rank 0 listens on loopback only: TCPStore itself listens
    on every interface, where any host could read and write the job's keys.
    """
    import torch.distributed as dist

    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    serves = env.rank == 0 and not agent_store
    try:
        store = dist.TCPStore(
            addr,
            port,
            is_master=serves,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
            master_listen_fd=listen_on_loopback(addr, port) if serves and is_loopback(addr) else None,
        )
        return dist.PrefixStore(store_prefix(), store)
    except Exception as exc:  # noqa: BLE001 - torch raises several types here
        if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
            raise UserError(
                f"rank 0 cannot serve the rendezvous on port {port} of {addr}: another program holds it "
                f"({first_line(exc)}); choose a free MASTER_PORT"
            ) from None
        raise UserError(
            f"cannot reach the rendezvous at {addr}:{port} within {timeout:.0f}s: "
            f"{first_line(exc)}; check MASTER_ADDR/MASTER_PORT and that rank 0 is running"
        ) from None


def store_prefix() -> str:
    """The prefix of this attempt's keys in the store (torchrun restarts get a new one)."""
    return f"trainbridge/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


REFUSED = "trainbridge/refused"  # a process of the job that cannot join says why here


def tell_the_job(message: str, environ=None, timeout: float = 10.0) -> None:
    """Leave ``message`` in the job's store at MASTER_ADDR:MASTER_PORT, where its ranks wait for this
    process, which will never join (a RANK outside WORLD_SIZE): they stop now instead of at their
    timeout. Best effort, for at most ``timeout`` seconds: a store that is not there is left alone."""
    import torch.distributed as dist

    environ = os.environ if environ is None else environ
    try:
        store = dist.TCPStore(
            environ["MASTER_ADDR"],
            int(environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
        )
        dist.PrefixStore(store_prefix(), store).set(REFUSED, message)
    except Exception:  # noqa: BLE001 - no store, no one waiting: nothing to tell
        pass


def listen_on_loopback(addr: str, port: int) -> int:
    """A socket listening on the loopback address ``addr`` only, for TCPStore to serve on (its descriptor)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's own: a restart binds at once
        sock.bind((addr, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock.detach()  # the store owns it from here


def launch_identity(environ=None) -> str:
    """The launcher's name for this job: the same on each of its ranks, another for the next job.

    torchrun's run id (unless its default "none"), SLURM's job and step, Open MPI's job id,
    horovodrun's rendezvous server; "" where the launcher gives none (env://, ``--nproc``).
    """
    environ = os.environ if environ is None else environ
    if environ.get("TORCHELASTIC_RUN_ID", "none") != "none":
        return f"torchrun run id {environ['TORCHELASTIC_RUN_ID']}"
    if environ.get("SLURM_JOB_ID"):
        return f"SLURM job {environ['SLURM_JOB_ID']}.{environ.get('SLURM_STEP_ID', '')}"
    if environ.get("OMPI_MCA_ess_base_jobid") or environ.get("PMIX_NAMESPACE"):
        return f"mpirun job {environ.get('OMPI_MCA_ess_base_jobid') or environ['PMIX_NAMESPACE']}"
    if environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"):
        server = f"{environ['HOROVOD_GLOO_RENDEZVOUS_ADDR']}:{environ.get('HOROVOD_GLOO_RENDEZVOUS_PORT', '')}"
        return f"horovodrun at {server}"
    return ""


def claim_rank(store, env: LaunchEnv, addr: str, port: int, identity: str) -> None:
    """Take this rank's place in the store, or fail at once when a process of another job holds it.

    Two jobs given one MASTER_PORT meet in the first one's store: the second job's rank 0
    cannot serve it (address in use), and without this its other ranks would join the
    first job's ranks. Each rank claims its number once, with a token naming its process
    and its job (:func:`launch_identity`); a claim already taken by another process means
    another job. The same process joining again (after ``job.shutdown()``) keeps its claim.
    """
    token = f"{identity or 'a job'}, host {socket.gethostname()}, pid {os.getpid()}"
    held = store.compare_set(f"trainbridge/rank/{env.rank}", "", token)
    held = held.decode() if isinstance(held, bytes) else str(held)
    if held != token:
        raise UserError(
            f"rank {env.rank} found its place in the rendezvous store at {addr}:{port} taken by another job's "
            f"rank {env.rank} ({held}): two jobs share MASTER_PORT {port}; give each job its own MASTER_PORT"
        )


def agree_on_world_size(store, env: LaunchEnv, timeout: float, identity: str = "") -> None:
    """Fail with both numbers, instead of waiting forever, when ranks were launched with different sizes
    or by different jobs (``identity``: :func:`launch_identity`).

    Every rank writes the size it was launched with and its job; rank 0 checks all of
    them, the others check rank 0's. A rank that never arrives ends in the
    store's timeout, which names the missing rank.
    """
    rank, world_size = env.rank, env.world_size
    store.set(f"trainbridge/world_size/{rank}", f"{world_size} {identity}")
    for other in range(1, world_size) if rank == 0 else [0]:
        key, deadline = f"trainbridge/world_size/{other}", time.monotonic() + timeout
        try:
            # Polled, not a blocking get: a process of the job that was refused (tell_the_job) ends the wait.
            while not store.check([key]):
                if store.check([REFUSED]):
                    refused = store.get(REFUSED)
                    raise UserError(
                        f"rank {rank}: a process of this job was refused and will never join "
                        f"({refused.decode() if isinstance(refused, bytes) else refused}); this rank stops too"
                    )
                if time.monotonic() > deadline:
                    raise UserError(
                        f"rank {other} did not join within {timeout:.0f}s (rank {rank} waited, "
                        f"expecting {world_size} processes); check that every rank was started"
                    )
                time.sleep(0.05)
            value = store.get(key)
        except UserError:
            raise
        except Exception:  # noqa: BLE001 - the store went away: rank 0 failed
            raise UserError(
                f"rank {rank} lost the rendezvous store on rank 0 before the job started; rank 0 failed: see its error"
            ) from None
        size, _, job = (value.decode() if isinstance(value, bytes) else str(value)).partition(" ")
        if job != identity:
            raise UserError(
                f"rank {rank} of {identity or 'this job'} met rank {other} of {job or 'a job without a launcher id'} "
                f"in one rendezvous store: two jobs share MASTER_PORT; give each job its own MASTER_PORT"
            )
        theirs = int(size)
        if theirs != world_size:
            if rank == 0:
                time.sleep(2.0)  # keep the store up so that the other ranks can see the mismatch too
            raise UserError(
                f"ranks disagree on the world size: rank {rank} was launched with "
                f"{world_size} processes, rank {other} with {theirs}; "
                f"launch every rank with the same WORLD_SIZE"
            )


def join_process_group(env: LaunchEnv, pg_backend: str, timeout: float) -> None:
    """Start torch.distributed's default process group (``pg_backend``: gloo or nccl) for this job."""
    import torch.distributed as dist

    # Imported before the group exists: torch.distributed.nn.functional takes the default
    # group as its functions' default arguments when it is first imported (torch._dynamo
    # imports it, with a model's first optimizer). Imported after this point, it would keep
    # the group and its gloo threads until the interpreter's teardown (runtime/gloo_threads.py).
    import torch.distributed.nn.functional  # noqa: F401

    addr, port = rendezvous_address(env, timeout=timeout)
    if pg_backend == "gloo":
        choose_gloo_interface(env, addr)
    store = open_store(env, timeout, addr, port)
    identity = launch_identity()
    claim_rank(store, env, addr, port, identity)  # a rank of another job on this port is refused here
    agree_on_world_size(store, env, timeout, identity)
    try:
        dist.init_process_group(
            pg_backend,
            store=store,
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
    except (RuntimeError, dist.DistError) as exc:
        # gloo's connectFullMesh: a peer advertised an address this rank cannot reach.
        # The peers still waiting end through the start-up watchdog (--timeout + 5 s).
        raise UserError(connect_failure(env, pg_backend, exc)) from None


def connect_failure(env: LaunchEnv, pg_backend: str, exc: BaseException) -> str:
    """One line for a process group whose ranks could not connect to each other, with the fix."""
    text = first_line(exc)
    fix = (
        "set GLOO_SOCKET_IFNAME to the interface that links the hosts, or map each host name to its "
        "network address in /etc/hosts (`trainbridge doctor --hosts` checks both)"
        if pg_backend == "gloo"
        else "set NCCL_SOCKET_IFNAME to the interface that links the hosts"
    )
    where = ""
    if env.local_size < env.world_size and "127.0." in text:
        where = "a peer on another host advertised a loopback address; "
    return f"rank {env.rank} could not connect to the other ranks ({text}); {where}{fix}"


def choose_gloo_interface(env: LaunchEnv, rendezvous_addr: str, environ=None) -> None:
    """Set GLOO_SOCKET_IFNAME when gloo's own choice would fail across hosts.

    gloo listens on the address this host's name resolves to, and on loopback
    when it does not resolve. When that is loopback and the job spans hosts, peers elsewhere cannot connect and rank 0
    would wait for them until the timeout. gloo is then given the interface that
    carries the route to the rendezvous address (or, where that address is this
    host's own name, the first interface that is not loopback). A
    GLOO_SOCKET_IFNAME set by the user is left alone.
    """
    environ = os.environ if environ is None else environ
    if environ.get("GLOO_SOCKET_IFNAME") or env.local_size >= env.world_size or is_loopback(rendezvous_addr):
        return
    host = socket.gethostname()
    addresses = resolve(host)
    if addresses and not all(is_loopback(a) for a in addresses):
        return  # gloo listens on the host name's network address
    interface = gloo_interface_for(rendezvous_addr)
    if interface is None and resolves_only_to_loopback(rendezvous_addr):
        interface = interface_of(first_external_address() or "")
    if interface is None:
        raise UserError(
            f"host name {host!r} {names_loopback(addresses)} and no "
            f"interface of this host routes to the rendezvous address {rendezvous_addr}, so ranks on "
            f"other hosts cannot connect; set GLOO_SOCKET_IFNAME to the interface that reaches them, "
            f"or map {host!r} to its network address in /etc/hosts"
        )
    environ["GLOO_SOCKET_IFNAME"] = interface
    if env.local_rank == 0:
        print(
            f"[trainbridge] host name {host!r} {names_loopback(addresses)}; gloo uses {interface}, the interface "
            f"towards {rendezvous_addr} (set GLOO_SOCKET_IFNAME to choose another)",
            file=sys.stderr,
            flush=True,
        )


def names_loopback(addresses) -> str:
    if not addresses:
        return "does not resolve (gloo takes loopback)"
    return f"resolves only to loopback ({', '.join(addresses)})"
