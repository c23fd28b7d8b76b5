"""trainbridge: one PyTorch training loop for every launcher.

::

    import trainbridge as tb
    job = tb.init()
    model, optimizer = job.prepare(model, optimizer)

See :mod:`trainbridge.api.job` for the whole API on one page.
"""

from .api import EvalLoader, Job, TrainLoader, exit_process, init, report_failure, spawn
from .errors import UserError
from .tasks.base import Task
from .version import __version__ as __version__  # trainbridge.__version__

__all__ = ["EvalLoader", "Job", "Task", "TrainLoader", "UserError", "exit_process", "init", "report_failure", "spawn"]
