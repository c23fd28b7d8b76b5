"""The public API (``import trainbridge as tb``): :func:`init` returns a :class:`Job`."""

from .files import read_file
from .job import Job, init
from .loaders import EvalLoader, TrainLoader
from .process_end import exit_process, report_failure
from .spawn import spawn

__all__ = ["EvalLoader", "Job", "TrainLoader", "exit_process", "init", "read_file", "report_failure", "spawn"]
