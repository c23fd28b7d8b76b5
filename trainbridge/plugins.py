"""One shape for every registry: ``name -> "module:attribute"``, imported on use.

Built-in tasks, backends and models are registered by name; users name their own
the same way, as ``mypkg.tasks:MyTask`` (an importable module) or
``./my_task.py:MyTask`` (a file). Importing on use keeps a missing optional
library (Horovod, torchvision) from breaking the entries that do not need it.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any, Mapping

from .errors import UserError, first_line


def resolve(spec: str, registry: Mapping[str, str], kind: str) -> Any:
    """The object named by ``spec``: a registry name, ``package.module:attr`` or ``path/file.py:attr``."""
    target = registry.get(spec, spec)
    if ":" not in target:
        raise UserError(f"unknown {kind} {spec!r}; choose one of {', '.join(registry)}, "
                        f"or name your own as package.module:Name or ./file.py:Name")
    module_name, _, attr = target.rpartition(":")
    module = _load_file(module_name, kind) if module_name.endswith(".py") else _import(module_name, kind)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UserError(f"{kind} {spec!r}: {module_name} has no {attr!r}; check the name after the colon") from None


def _import(module_name: str, kind: str):
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"{kind} module {module_name!r} cannot be imported ({first_line(exc)}); "
                        f"install it or put it on PYTHONPATH, or give a file as ./file.py:Name") from None


def _load_file(path: str, kind: str):
    if not os.path.isfile(path):
        raise UserError(f"{kind} file {path} does not exist; give the path of a .py file as ./file.py:Name")
    name = "trainbridge_user_" + os.path.splitext(os.path.basename(path))[0]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.abspath(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec: pickling (spawned workers) and dataclasses look it up
    spec.loader.exec_module(module)
    return module
