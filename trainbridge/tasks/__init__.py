"""Task registry: ``--task NAME`` -> a :class:`~trainbridge.tasks.base.Task`."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Type

from ..errors import UserError
from ..plugins import resolve
from .base import Task
from .options import option

TASKS: Dict[str, str] = {
    "mnist": "trainbridge.tasks.mnist:MnistTask",
    "designsafe": "trainbridge.tasks.designsafe:DesignSafeTask",
}


def task_class(spec: str) -> Type[Task]:
    """A built-in task's class by name, or the user's as ``package.module:Class`` or ``./file.py:Class``."""
    cls = resolve(spec, TASKS, "task")
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise UserError(
            f"task {spec!r} is not a subclass of trainbridge.Task; derive it from trainbridge.Task "
            f"(see the README's Task section)"
        )
    missing = sorted(cls.__abstractmethods__)
    if missing == ["load_data"] and "prepare" in vars(cls):  # its name until 0.1.0
        raise UserError(f"task {spec!r}: {cls.__name__}.prepare is now called load_data; rename the method")
    if missing:
        raise UserError(
            f"task {spec!r}: {cls.__name__} does not define {', '.join(missing)}; define them in the class "
            f"(every task defines {', '.join(sorted(Task.__abstractmethods__))})"
        )
    if hasattr(cls, "add_arguments"):  # the earlier form of its options
        raise UserError(
            f"task {spec!r}: {cls.__name__}.add_arguments is replaced by declared options; declare each "
            f"as a field of a dataclass {cls.__name__}.Options, made with trainbridge.tasks.option(...) "
            f"(see docs/guides/own-task.md)"
        )
    undeclared = (
        []
        if not dataclasses.is_dataclass(cls.Options)
        else [field.name for field in dataclasses.fields(cls.Options) if "option" not in field.metadata]
    )
    if not dataclasses.is_dataclass(cls.Options) or undeclared:
        raise UserError(
            f"task {spec!r}: {cls.__name__}.Options must be a dataclass whose fields are made with "
            f"trainbridge.tasks.option(...)"
            f"{' (not ' + ', '.join(undeclared) + ')' if undeclared else ''}; see docs/guides/own-task.md"
        )
    return cls


def create_task(spec: str, options: Any = None) -> Task:
    """The task ``spec`` names, given its options (an instance of its ``Options``; None: their defaults)."""
    cls = task_class(spec)
    task = cls()
    task.options = options if options is not None else cls.Options()
    return task


__all__ = ["TASKS", "Task", "create_task", "option", "task_class"]
