"""Horovod's runtime variables on the torch backend: each is honoured, or refused in one line at ``hvd.init()``.

Read once by :func:`read` (``hvd.init()`` calls it before it joins the job, so a refusal
never leaves a peer waiting). Honoured, with Horovod 0.28.1's meaning and default:

==================================  =========================  ==============================================
variable                            default                    meaning here
==================================  =========================  ==============================================
HOROVOD_FUSION_THRESHOLD            134217728 (128 MiB)        bytes per fused allreduce buffer; 0: no fusion
HOROVOD_CYCLE_TIME                  1                          milliseconds from one negotiation cycle's start
                                                               to the next (ops submitted meanwhile fuse)
HOROVOD_TIMELINE                    unset                      rank 0 writes the Chrome-trace timeline there;
                                                               ``DYNAMIC``: only between start/stop_timeline
HOROVOD_TIMELINE_MARK_CYCLES        0                          ``1``: a CYCLE_START mark per cycle
HOROVOD_DISABLE_GROUP_FUSION        0                          ``1``: a grouped op's tensors fuse only together
HOROVOD_LOG_LEVEL                   warning                    trace, debug, info, warning, error or fatal
HOROVOD_LOG_HIDE_TIME               0                          ``1``: log lines without the time
HOROVOD_GLOO_IFACE                  unset                      the network interface gloo uses
                                                               (GLOO_SOCKET_IFNAME, unless that is set)
HOROVOD_CACHE_CAPACITY              1024                       operations held in the response cache
                                                               (:mod:`.response_cache`); 0: no cache
==================================  =========================  ==============================================

The stall variables (``HOROVOD_STALL_CHECK_*``, ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``) are read by the
engine and ``HOROVOD_DYNAMIC_PROCESS_SETS`` by :mod:`.process_sets`; horovodrun's own variables
(``HOROVOD_RANK``, ``HOROVOD_GLOO_RENDEZVOUS_ADDR``, ..., ``HOROVOD_CONTROLLER=gloo``) by :mod:`trainbridge.launch`.
Every other runtime variable of Horovod 0.28.1 (:data:`REFUSED`) asks for something the torch backend does
not do; set to such a value it is refused, naming the variable and what to do instead. Set to the value
that describes what the torch backend does anyway (``HOROVOD_AUTOTUNE=0``), it is accepted. A bad value of
an honoured variable is refused too (Horovod reads ``64MB`` as 64 bytes).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Dict, Mapping, Optional, Tuple

from ..errors import UserError

DEFAULT_FUSION_BYTES = 128 * 1024 * 1024
DEFAULT_CYCLE_TIME_MS = 1.0
LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "fatal")
HOROVODRUN = "launch with horovodrun (the real Horovod)"
HOROVODRUN_MPI = "launch with horovodrun --mpi (the real Horovod)"
NO_AUTOTUNE = f"the torch backend does not autotune; unset it, or {HOROVODRUN}"


@dataclasses.dataclass(frozen=True)
class Settings:
    """What ``hvd.init()`` read; the defaults are Horovod's."""

    fusion_bytes: int = DEFAULT_FUSION_BYTES
    cycle_time_s: float = DEFAULT_CYCLE_TIME_MS / 1000
    timeline: Optional[str] = None  # None: no timeline; "": HOROVOD_TIMELINE=DYNAMIC; else the file
    mark_cycles: bool = False
    group_fusion: bool = True
    log_level: str = "warning"
    log_time: bool = True
    gloo_iface: Optional[str] = None
    cache_capacity: int = 1024


DEFAULT_SETTINGS = Settings()


def _positive(value: str) -> bool:
    """Horovod's switch test (``strtol(value) > 0``), for values that are integers."""
    try:
        return int(value) > 0
    except ValueError:
        return True  # not a number: it asks for something, so it is refused with the rest


def _set(value: str) -> bool:
    return value != ""


def _not(expected: str) -> Callable[[str], bool]:
    return lambda value: value.strip().lower() != expected


# variable -> (does this value ask for something the torch backend does not do?, what to do instead)
REFUSED: Dict[str, Tuple[Callable[[str], bool], str]] = {
    "HOROVOD_AUTOTUNE": (
        _positive,
        "the torch backend does not autotune: set HOROVOD_FUSION_THRESHOLD and "
        f"HOROVOD_CYCLE_TIME yourself (the autotuner's main knobs), or {HOROVODRUN}",
    ),
    "HOROVOD_AUTOTUNE_LOG": (_set, NO_AUTOTUNE),
    "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": (_set, NO_AUTOTUNE),
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": (_set, NO_AUTOTUNE),
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": (_set, NO_AUTOTUNE),
    "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": (_set, NO_AUTOTUNE),
    "HOROVOD_HIERARCHICAL_ALLREDUCE": (
        _positive,
        "the torch backend reduces with gloo's and nccl's own "
        f"algorithms (nccl chooses ring or tree across nodes itself); unset it, or "
        f"{HOROVODRUN}",
    ),
    "HOROVOD_HIERARCHICAL_ALLGATHER": (
        _positive,
        f"the torch backend gathers with gloo and nccl; unset it, or {HOROVODRUN}",
    ),
    "HOROVOD_TORUS_ALLREDUCE": (_positive, f"the torch backend reduces with gloo and nccl; unset it, or {HOROVODRUN}"),
    "HOROVOD_CPU_OPERATIONS": (
        _not("gloo"),
        f"the torch backend runs CPU collectives over gloo (set it to gloo or unset it), or {HOROVODRUN_MPI}",
    ),
    "HOROVOD_CONTROLLER": (
        _not("gloo"),
        f"the torch backend negotiates over gloo (set it to gloo or unset it), or {HOROVODRUN_MPI}",
    ),
    "HOROVOD_MPI_THREADS_DISABLE": (
        _positive,
        "the torch backend does not run collectives over MPI (mpirun only starts its processes); unset it",
    ),
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE": (_set, f"Adasum needs the real Horovod; unset it, or {HOROVODRUN}"),
    "HOROVOD_NUM_NCCL_STREAMS": (_not("1"), "the torch backend runs nccl on one stream per process set; unset it"),
    "HOROVOD_BATCH_D2D_MEMCOPIES": (
        _positive,
        "the torch backend fills fusion buffers with torch.cat, not a batched copy kernel; set it to 0 or unset it",
    ),
    "HOROVOD_THREAD_AFFINITY": (
        _set,
        "the torch backend does not pin its engine thread; unset it and bind the processes with taskset, numactl "
        "or your launcher's binding options",
    ),
    "HOROVOD_DISABLE_NVTX_RANGES": (
        _not("1"),
        "the torch backend writes no NVTX ranges (use torch.profiler); set it to 1 or unset it",
    ),
    "HOROVOD_ENABLE_ASYNC_COMPLETION": (
        _positive,
        "the torch backend completes each operation on its engine thread; unset it",
    ),
    "HOROVOD_ENABLE_XLA_OPS": (_positive, "XLA ops are TensorFlow's; unset it"),
    "HOROVOD_CCL_CACHE": (_positive, f"oneCCL needs the real Horovod; unset it, or {HOROVODRUN}"),
    "HOROVOD_ELASTIC": (
        _positive,
        "elastic jobs on the torch backend restart under torchrun --max-restarts "
        "(docs/MIGRATING_FROM_HOROVOD.md, Elastic training); unset it",
    ),
}


def _refuse(name: str, value: str, why: str) -> UserError:
    return UserError(f"{name}={value}: {why}")


def _integer(
    environ: Mapping[str, str], name: str, default: int, what: str = "bytes (e.g. 67108864 for 64 MiB)"
) -> int:
    value = environ.get(name, "").strip()
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise _refuse(name, value, f"give a whole number, 0 or more, of {what}")
    return number


def _milliseconds(environ: Mapping[str, str], name: str, default: float) -> float:
    value = environ.get(name, "").strip()
    if not value:
        return default
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number >= 0:  # also NaN
        raise _refuse(name, value, "give milliseconds, 0 or more (e.g. 5 or 0.5)")
    return number


def _switch(environ: Mapping[str, str], name: str) -> bool:
    value = environ.get(name, "").strip()
    if value.lower() in ("", "0", "false"):
        return False
    if value.lower() in ("1", "true"):
        return True
    raise _refuse(name, value, "give 1 or 0")


def read(environ: Mapping[str, str] = os.environ) -> Settings:
    """The settings ``environ`` asks for; a :class:`UserError` naming the variable for one that is refused."""
    for name, (refused, why) in REFUSED.items():
        value = environ.get(name)
        if value is not None and refused(value.strip()):
            raise _refuse(name, value, why)
    level = environ.get("HOROVOD_LOG_LEVEL", "warning").strip().lower() or "warning"
    if level not in LOG_LEVELS:
        raise _refuse("HOROVOD_LOG_LEVEL", level, f"give one of {', '.join(LOG_LEVELS)}")
    timeline = environ.get("HOROVOD_TIMELINE", "").strip() or None
    return Settings(
        fusion_bytes=_integer(environ, "HOROVOD_FUSION_THRESHOLD", DEFAULT_FUSION_BYTES),
        cycle_time_s=_milliseconds(environ, "HOROVOD_CYCLE_TIME", DEFAULT_CYCLE_TIME_MS) / 1000,
        timeline="" if timeline == "DYNAMIC" else timeline,
        mark_cycles=_switch(environ, "HOROVOD_TIMELINE_MARK_CYCLES"),
        group_fusion=not _switch(environ, "HOROVOD_DISABLE_GROUP_FUSION"),
        log_level=level,
        log_time=not _switch(environ, "HOROVOD_LOG_HIDE_TIME"),
        gloo_iface=environ.get("HOROVOD_GLOO_IFACE", "").strip() or None,
        cache_capacity=_integer(environ, "HOROVOD_CACHE_CAPACITY", 1024, "names (0 turns the cache off)"),
    )
