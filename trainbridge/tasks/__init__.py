"""Task registry: ``--task NAME`` -> a :class:`~trainbridge.tasks.base.Task`."""
from __future__ import annotations

import importlib
from typing import Dict

from ..errors import UserError
from .base import Task

TASKS: Dict[str, str] = {
    "mnist": "trainbridge.tasks.mnist:MnistTask",
    "designsafe": "trainbridge.tasks.designsafe:DesignSafeTask",
}


def create_task(name: str) -> Task:
    if name not in TASKS:
        raise UserError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    module_name, class_name = TASKS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)()


__all__ = ["TASKS", "Task", "create_task"]
