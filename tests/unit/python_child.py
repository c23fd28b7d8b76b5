"""Running a few lines of Python in a child process, for the units that end their process
(``os._exit`` in the watchdog and fault injection, death by SIGTERM)."""
from __future__ import annotations

import subprocess
import textwrap

from conftest import PYTHON, run  # tests/conftest.py: loaded by pytest first, as the module "conftest"


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -c code`` (dedented) in a session of its own, with no launcher's variables; killed on timeout."""
    return run([PYTHON, "-c", textwrap.dedent(code)], timeout=timeout)
