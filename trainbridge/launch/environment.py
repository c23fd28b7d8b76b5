"""What a launcher tells a process about its place in the job.

Each launcher (torchrun, horovodrun, mpirun, srun, plain python, our own
spawner) is one small module in this package exposing ``detect(environ)``, which
returns a :class:`LaunchEnv` or ``None``. Detection only *reads* the environment;
it never initialises a collective library.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional, overload

from ..errors import UserError


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """Rank layout as announced by the launcher, before any backend starts."""

    launcher: str  # "torchrun", "horovodrun", "mpirun", "srun", "spawn", "env" or "python"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_size: int = 1
    node_rank: int = 0
    # Rendezvous address for torch.distributed, when the launcher provides one.
    master_addr: Optional[str] = None
    master_port: Optional[int] = None


@overload
def read_int(environ: Mapping[str, str], *names: str, default: int) -> int: ...


@overload
def read_int(environ: Mapping[str, str], *names: str, default: None = None) -> Optional[int]: ...


def read_int(environ: Mapping[str, str], *names: str, default: Optional[int] = None) -> Optional[int]:
    """The first of ``names`` present in ``environ``, as an int (one line if it is not one)."""
    for name in names:
        value = environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                digits = value.strip().lstrip("+-")
                if digits.isdigit():  # past Python's 4,300-digit limit for int()
                    raise UserError(
                        f"the environment variable {name} holds a number of {len(digits)} digits, far too large "
                        f"for a count of processes, ranks or a port; set it to the intended value (or unset it)"
                    ) from None
                shown = value if len(value) <= 40 else value[:40] + "..."
                raise UserError(
                    f"the environment variable {name}={shown!r} is not a whole number; set it to one (or unset it)"
                ) from None
    return default


def read_port(environ: Mapping[str, str], name: str) -> Optional[int]:
    """``name`` as a TCP port (1 to 65535), None when unset; one line naming it otherwise."""
    port = read_int(environ, name)
    if port is not None and not 1 <= port <= 65535:
        raise UserError(f"{name}={port} is not a TCP port; set it to a free port from 1 to 65535 (e.g. 29500)")
    return port


def required_int(environ: Mapping[str, str], name: str) -> int:
    """``name``, which the launcher sets, as an int; one line if it is empty or not a number."""
    value = read_int(environ, name)
    if value is None:
        raise UserError(
            f"the environment variable {name} is empty; the launcher sets it: start the job with "
            f"the launcher again (or unset it)"
        )
    return value


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask: what taskset, SLURM and cgroups allow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
