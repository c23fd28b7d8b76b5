"""The public API (``import trainbridge as tb``): :func:`init` returns a :class:`Job`."""
from .files import read_file
from .job import Job, init
from .loaders import EvalLoader, TrainLoader
from .spawn import spawn

__all__ = ["EvalLoader", "Job", "TrainLoader", "init", "read_file", "spawn"]
