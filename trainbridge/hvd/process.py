"""hvd.init() / shutdown() and the rank layout, on torch.distributed.

``init()`` joins the job with :func:`trainbridge.launch.rendezvous.join_process_group`,
the same rendezvous as the trainbridge torch backend (the launcher's address,
torchrun's agent store, mpi4py under mpirun, a one-rank group under plain
python; ranks launched with different world sizes fail with both numbers),
unless the default process group already exists. Like Horovod's, it
does not pick a GPU (scripts call ``torch.cuda.set_device(hvd.local_rank())``),
so the default group is gloo. It then creates the engine's own groups: gloo for
negotiation and CPU tensors, plus nccl for CUDA tensors when CUDA is available.

``init(process_sets=[...])`` registers static process sets (every rank must pass
the same ones, else ValueError on every rank); ``process_sets="dynamic"`` allows
``hvd.add_process_set`` later (see :mod:`.process_sets`). ``comm=`` (MPI
communicators) needs the real Horovod.

Environment read: the launcher's variables (see :mod:`trainbridge.launch`),
Horovod's runtime variables (:mod:`.settings`: each honoured, or refused in one line
and exit status 2 before this rank joins the job), ``TRAINBRIDGE_HVD_TIMEOUT``
(seconds a rank waits for its peers: to join, in a collective; the job's timeout, default 300 s as ``tb.init``'s, see
:mod:`trainbridge.runtime.timeout`), ``HOROVOD_STALL_CHECK_TIME_SECONDS`` /
``HOROVOD_STALL_CHECK_DISABLE`` (the stall warning) and
``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` (seconds after which a stalled operation shuts
the job down; default and upper bound: the timeout; 0 means the timeout),
``HOROVOD_DYNAMIC_PROCESS_SETS``. The default process
group outlives ``shutdown()`` so that ``init()`` may be called again; it is
destroyed at interpreter exit.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import sys
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from ..errors import UserError
from ..launch import detect_launch
from ..launch.rendezvous import join_process_group
from ..runtime.gloo_threads import keep_thread_states
from ..runtime.timeout import timeout_from_environ
from . import running_job, settings as horovod_settings
from .engine import Engine
from .log import configure as configure_log, log
from .process_sets import check_static_sets, global_process_set, static_sets
from .running_job import Runtime, is_initialized, runtime
from .timeline import Timeline

_owns_default_group = False  # whether init() created the default process group
_atexit_registered = False


def _stall_shutdown(timeout: float) -> float:
    """Seconds a stalled operation may wait before the job shuts down (never more than ``timeout``)."""
    seconds = float(os.environ.get("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0) or 0)
    return min(seconds, timeout) if seconds > 0 else timeout


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Join the job (idempotent); register ``process_sets`` (a list of hvd.ProcessSet, or "dynamic").

    The job's timeout bounds every wait for the peers, joining included: ``TRAINBRIDGE_HVD_TIMEOUT``
    seconds, default 300 as ``tb.init(timeout=...)`` (``hvd.init`` keeps Horovod's signature).
    """
    global _owns_default_group, _atexit_registered
    if comm not in (None, []):
        raise NotImplementedError(
            "hvd.init(comm=...) (MPI communicators) needs the real Horovod (start the job "
            "with horovodrun --mpi); on the torch backend use hvd.init(process_sets=[...])"
        )
    sets = static_sets(process_sets)
    if is_initialized():
        return
    env = detect_launch()
    try:
        settings = horovod_settings.read(os.environ)
    except UserError as exc:
        # Before joining: every rank reads its own environment and leaves, none waits for another.
        if env.rank == 0:
            print(f"trainbridge: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    configure_log(settings)
    if settings.gloo_iface and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = settings.gloo_iface  # Horovod's HOROVOD_GLOO_IFACE, in gloo's words
    timeout = timeout_from_environ()
    stall_shutdown = _stall_shutdown(timeout)
    if not dist.is_initialized():
        # The torch backend's rendezvous and process group, without its one-GPU-per-rank
        # device choice: as with Horovod, the script calls torch.cuda.set_device itself,
        # so the default group is gloo (the engine adds an nccl group for CUDA tensors).
        join_process_group(env, "gloo", timeout=timeout)
        keep_thread_states()
        _owns_default_group = True
    rank, size = dist.get_rank(), dist.get_world_size()
    # The negotiation group's timeout is the stall shutdown limit: a peer that stops
    # cycling while this rank waits for it ends the wait there (see engine.py).
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=stall_shutdown))
    groups = [control]
    cuda_group = None
    if torch.cuda.is_available() and dist.is_nccl_available():
        cuda_group = dist.new_group(backend="nccl", timeout=datetime.timedelta(seconds=timeout))
        groups.append(cuda_group)
    keep_thread_states(control)
    # Horovod's cross rank/size: the ranks that share this process's local rank, one per node.
    # The static process sets travel along, so that every rank checks them the same way.
    local_rank, local_size = env.local_rank, env.local_size
    layouts: List[Any] = [None] * size
    dist.all_gather_object(layouts, (local_rank, local_size, [tuple(ps.ranks) for ps in sets]), group=control)
    try:
        check_static_sets([requested for _, _, requested in layouts], size)
    except ValueError:
        for group in groups:
            dist.destroy_process_group(group)
        raise
    peers = [r for r, (lr, _, _) in enumerate(layouts) if lr == local_rank]
    # Horovod's coordinator writes the timeline: rank 0 here.
    timeline = None
    if settings.timeline is not None and rank == 0:
        timeline = Timeline(settings.timeline, settings.mark_cycles)
    engine = Engine(
        rank,
        size,
        control,
        cuda_group,
        settings=settings,
        timeline=timeline,
        static_sets=[tuple(ps.ranks) for ps in sets],
        timeout=timeout,
        stall_shutdown_s=stall_shutdown,
    )
    for set_id, ps in enumerate(sets, start=1):
        ps.process_set_id = set_id
    global_process_set.ranks = list(range(size))
    running_job.replace(
        Runtime(
            rank,
            size,
            local_rank,
            local_size,
            peers.index(rank),
            len(peers),
            len({ls for _, ls, _ in layouts}) == 1,
            engine,
            groups,
            settings,
            timeline,
        )
    )
    log(
        "info",
        f"rank {rank} of {size} joined; fusion threshold {settings.fusion_bytes} bytes, cycle time "
        f"{settings.cycle_time_s * 1000:g} ms, timeline {_timeline_state(settings, timeline)}",
    )
    if not _atexit_registered:
        atexit.register(_at_exit)
        _atexit_registered = True


def shutdown() -> None:
    """Leave the job; pending operations on every rank fail with HorovodInternalError."""
    current = running_job.replace(None)
    if current is None:
        return
    current.engine.stop()
    if current.timeline is not None:
        current.timeline.close()
    for group in current.groups:
        dist.destroy_process_group(group)


def _at_exit() -> None:
    global _owns_default_group
    try:
        shutdown()
    finally:
        if _owns_default_group and dist.is_initialized():
            # Every rank's engine stopped at the same cycle, so nothing is in flight: no barrier needed.
            dist.destroy_process_group()
        _owns_default_group = False
        # The engine's objects sit in reference cycles: collected now, the last reference to each
        # gloo group goes and its worker threads are joined while Python still runs, not in the
        # interpreter's teardown, where they can abort the process (runtime/gloo_threads.py).
        gc.collect()


def size() -> int:
    """Number of ranks in the job (Horovod's ``hvd.size()``); ``ValueError`` before :func:`init`."""
    return runtime().size


def rank() -> int:
    """This process's rank in the job, 0 to ``size() - 1``."""
    return runtime().rank


def local_size() -> int:
    """Number of ranks on this host."""
    return runtime().local_size


def local_rank() -> int:
    """This process's rank among the ranks on its host (the GPU index to use)."""
    return runtime().local_rank


def cross_size() -> int:
    """Number of hosts that have a rank with this process's local rank."""
    return runtime().cross_size


def cross_rank() -> int:
    """This host's index among the hosts (for ranks with the same local rank)."""
    return runtime().cross_rank


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks (a trainbridge addition, absent under horovodrun)."""
    return runtime().homogeneous


def _timeline_state(settings: horovod_settings.Settings, timeline: Optional[Timeline]) -> str:
    if settings.timeline is None:
        return "off"
    if timeline is None:
        return "written by rank 0"
    return f"in {settings.timeline}" if settings.timeline else "ready (HOROVOD_TIMELINE=DYNAMIC)"


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Write Horovod's timeline to ``file_path`` (rank 0 writes; see :mod:`.timeline`), closing the one
    written so far; ``mark_cycles`` marks each cycle. Needs ``HOROVOD_TIMELINE`` (a file, or ``DYNAMIC``)
    at ``hvd.init()``, as in Horovod; ``ValueError`` otherwise, and before ``init()``."""
    current = runtime()
    if current.settings.timeline is None:
        raise ValueError("Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage.")
    if current.timeline is not None:
        current.timeline.start(file_path, mark_cycles)


def stop_timeline() -> None:
    """Finish and close the timeline file (rank 0); a no-op when none is being written. ``ValueError``
    before ``hvd.init()``."""
    current = runtime()
    if current.timeline is not None:
        current.timeline.stop()
