"""The public API (``import trainbridge as tb``): :func:`init` returns a :class:`Job`."""
from .job import Job, init, read_file
from .loaders import EvalLoader, TrainLoader
from .spawn import spawn

__all__ = ["EvalLoader", "Job", "TrainLoader", "init", "read_file", "spawn"]
