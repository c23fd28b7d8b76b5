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
import traceback
from typing import Any, Mapping

from .errors import UserError, first_line

IMPORTLIB = os.path.dirname(importlib.__file__)  # its frames sit between the import and the user's file


def resolve(spec: str, registry: Mapping[str, str], kind: str) -> Any:
    """The object named by ``spec``: a registry name, ``package.module:attr`` or ``path/file.py:attr``."""
    target = registry.get(spec, spec)
    if ":" not in target:
        raise UserError(
            f"unknown {kind} {spec!r}; choose one of {', '.join(registry)}, "
            f"or name your own as package.module:Name or ./file.py:Name"
        )
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
        if module_name == exc.name or module_name.startswith(f"{exc.name}."):  # the module itself is missing
            raise UserError(
                f"{kind} module {module_name!r} cannot be imported ({first_line(exc)}); "
                f"install it or put it on PYTHONPATH, or give a file as ./file.py:Name"
            ) from None
        raise import_failure(kind, module_name, exc) from None
    except (Exception, SystemExit) as exc:
        raise import_failure(kind, module_name, exc) from None


def _load_file(path: str, kind: str):
    if os.path.isdir(path):
        raise UserError(
            f"{kind} file {path} is a directory, not a .py file; give the path of a .py file in it as ./file.py:Name"
        )
    if not os.path.isfile(path):
        raise UserError(f"{kind} file {path} does not exist; give the path of a .py file as ./file.py:Name")
    name = "trainbridge_user_" + os.path.splitext(os.path.basename(path))[0]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.abspath(path))
    if spec is None or spec.loader is None:  # not a file Python can import (no .py ending)
        raise UserError(
            f"{kind} file {path} cannot be imported as Python; give the path of a .py file as ./file.py:Name"
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec: pickling (spawned workers) and dataclasses look it up
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # SystemExit: a script's sys.exit() must not end the run as a success
        del sys.modules[name]
        raise import_failure(kind, os.path.abspath(path), exc) from None
    return module


def import_failure(kind: str, source: str, exc: BaseException) -> UserError:
    """One line for a user's module that failed while it was imported: where, what, and how to fix it.

    ``source`` is what the command line named: a file's path or a module's name. The
    line named is the imported file's last one that the failure passed through; the
    whole traceback is one ``python FILE`` (or ``python -c "import MODULE"``) away.
    """
    if isinstance(exc, SyntaxError):
        return UserError(
            f"{kind} file {exc.filename}, line {exc.lineno}: syntax error ({exc.msg}); correct it "
            f"(python -m py_compile {exc.filename} shows the spot)"
        )
    # The user's frames start with the imported file; its last line there is where it went wrong.
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if f.filename != __file__ and not f.filename.startswith(("<frozen importlib", IMPORTLIB))
    ]
    own = [f for f in frames if f.filename == frames[0].filename] if frames else []
    place = f"{own[-1].filename}, line {own[-1].lineno}" if own else source
    if isinstance(exc, SystemExit):
        return UserError(
            f"{kind} file {place}: calls sys.exit({exc.code!r}) while being imported, so nothing "
            f"would be trained; put script code under if __name__ == '__main__':"
        )
    rerun = f"python {source}" if source.endswith(".py") else f'python -c "import {source}"'
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return UserError(
            f"{kind} file {place}: {first_line(exc)}; install the package that provides {exc.name!r} "
            f"into this Python ({sys.executable}), or remove the import"
        )
    if isinstance(exc, ImportError):
        return UserError(
            f"{kind} file {place}: {first_line(exc)}; check the import against the installed "
            f"version ({rerun} shows the traceback)"
        )
    return UserError(
        f"{kind} file {place}: importing it raised {type(exc).__name__}: {first_line(exc)}; "
        f"fix the file ({rerun} shows the traceback)"
    )
