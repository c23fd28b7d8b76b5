"""Optional dependencies: the packages the core does not need, and the one line that says how to add them.

``pip install trainbridge`` installs the core (the public API, ``trainbridge.hvd``,
``trainbridge doctor``). The built-in tasks, their progress bar and reports, and
the torch backend under mpirun need more; each such package belongs to an extra
of setup.cfg, listed here once. Where one is missing, :func:`require` and
:func:`check_installed` raise a :class:`~trainbridge.errors.UserError` naming the
package, what needs it and the ``pip install`` that adds it.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Dict, Iterable, Tuple

from .errors import UserError

# Importable name -> (the package pip installs, the extra of setup.cfg that brings it).
OPTIONAL: Dict[str, Tuple[str, str]] = {
    "torchvision": ("torchvision", "tasks"),
    "PIL": ("pillow", "tasks"),
    "mlxtend": ("mlxtend", "tasks"),
    "tqdm": ("tqdm", "tasks"),
    "matplotlib": ("matplotlib", "tasks"),
    "mpi4py": ("mpi4py", "mpi"),
}


def missing_error(module: str, purpose: str, instead: str = "", quiet: bool = False) -> UserError:
    """The one line for the optional ``module`` (a key of :data:`OPTIONAL`) that ``purpose`` needs."""
    package, extra = OPTIONAL[module]
    return UserError(
        f"{package} is not installed, and {purpose} needs it; "
        f'pip install "trainbridge[{extra}]" adds it{f", {instead}" if instead else ""}',
        quiet=quiet,
    )


def require(module: str, purpose: str, instead: str = "", quiet: bool = False) -> ModuleType:
    """Import ``module`` (dotted names allowed), or raise the one line for the optional package that is missing.

    ``instead`` names another way out (``"or pass --no-progress"``). An ImportError of a package
    that is not optional (a broken installation) keeps its traceback.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = (exc.name or "").partition(".")[0]
        if top not in OPTIONAL:
            raise
        raise missing_error(top, purpose, instead, quiet) from None


def check_installed(modules: Iterable[str], purpose: str, instead: str = "", quiet: bool = False) -> None:
    """Raise the one line for the first of ``modules`` (keys of :data:`OPTIONAL`) that is not installed.

    Imports nothing: for checks before training of what is only used after it.
    """
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise missing_error(module, purpose, instead, quiet)
