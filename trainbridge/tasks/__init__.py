"""Task registry: ``--task NAME`` -> a :class:`~trainbridge.tasks.base.Task`."""
from __future__ import annotations

from typing import Dict

from ..errors import UserError
from ..plugins import resolve
from .base import Task

TASKS: Dict[str, str] = {
    "mnist": "trainbridge.tasks.mnist:MnistTask",
    "designsafe": "trainbridge.tasks.designsafe:DesignSafeTask",
}


def create_task(spec: str) -> Task:
    """A built-in task by name, or the user's as ``package.module:Class`` or ``./file.py:Class``."""
    cls = resolve(spec, TASKS, "task")
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise UserError(f"task {spec!r} is not a subclass of trainbridge.Task; derive it from trainbridge.Task "
                        f"(see the README's Task section)")
    missing = sorted(cls.__abstractmethods__)
    if missing == ["load_data"] and "prepare" in vars(cls):  # its name until 0.1.0
        raise UserError(f"task {spec!r}: {cls.__name__}.prepare is now called load_data; rename the method")
    if missing:
        raise UserError(f"task {spec!r}: {cls.__name__} does not define {', '.join(missing)}; define them in the class "
                        f"(every task defines {', '.join(sorted(Task.__abstractmethods__))})")
    return cls()


__all__ = ["TASKS", "Task", "create_task"]
