"""trainbridge: one PyTorch training loop for every launcher.

::

    import trainbridge as tb
    job = tb.init()
    model, optimizer = job.prepare(model, optimizer)

See :mod:`trainbridge.api.job` for the whole API on one page.
"""
__version__ = "0.1.0"

from .api import EvalLoader, Job, TrainLoader, exit_process, init, report_failure, spawn  # noqa: E402
from .errors import UserError  # noqa: E402
from .tasks.base import Task  # noqa: E402

__all__ = ["EvalLoader", "Job", "Task", "TrainLoader", "UserError", "exit_process", "init", "report_failure",
           "spawn"]
