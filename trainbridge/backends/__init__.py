"""Backend registry and ``--backend auto``.

A new backend is one module with a :class:`~trainbridge.backends.base.Backend`
subclass plus one line in ``BACKENDS``.

``auto`` picks by launcher (see :mod:`trainbridge.launch`):

=================  =====================================================
launcher           backend
=================  =====================================================
torchrun, spawn    torch
env (env://)       torch
horovodrun         horovod
mpirun             horovod when this Horovod can train PyTorch models, else torch
srun               torch
plain python       local
=================  =====================================================
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

from ..errors import UserError
from ..launch import LaunchEnv
from ..plugins import resolve
from .base import Backend, GradientExchange

# name -> "module:Class", imported only when chosen, so that a missing Horovod
# never breaks the torch or local backends.
BACKENDS: Dict[str, str] = {
    "torch": "trainbridge.backends.torch_ddp:TorchBackend",
    "horovod": "trainbridge.backends.horovod:HorovodBackend",
    "local": "trainbridge.backends.local:LocalBackend",
}

AUTO_BY_LAUNCHER = {
    "torchrun": "torch",
    "spawn": "torch",
    "env": "torch",
    "horovodrun": "horovod",
    "srun": "torch",
    "python": "local",
}


def horovod_usable() -> bool:
    """Horovod with its PyTorch operations and a controller (a broken build is passed over, not picked)."""
    from .horovod import horovod_problem

    return horovod_problem() is None


def choose_backend(requested: str, env: LaunchEnv, horovod_available: Optional[Callable[[], bool]] = None) -> str:
    """The backend name for ``--backend requested`` under this launcher."""
    if requested != "auto":
        if requested not in BACKENDS:
            raise UserError(f"unknown backend {requested!r}; choose one of auto, {', '.join(BACKENDS)}")
        return requested
    if env.launcher == "mpirun":
        return "horovod" if (horovod_available or horovod_usable)() else "torch"
    return AUTO_BY_LAUNCHER[env.launcher]


def create_backend(requested: str, env: LaunchEnv, **options) -> Backend:
    """Construct (not yet init) the backend chosen for ``requested`` under ``env``; ``options`` go to
    :class:`~trainbridge.backends.base.Backend` (dist_backend, timeout)."""
    return resolve(choose_backend(requested, env), BACKENDS, "backend")(env, **options)


__all__ = ["Backend", "BACKENDS", "GradientExchange", "choose_backend", "create_backend"]
