"""Call ``tb.init`` with the keyword arguments given as ``key=value`` on the command line, then train nothing.

    torchrun --nproc-per-node 2 tests/api_scripts/init_with.py backend=horovod
"""
import sys

import trainbridge as tb

if __name__ == "__main__":
    options = dict(argument.split("=", 1) for argument in sys.argv[1:])
    job = tb.init(**options)
    job.print(f"initialized: {job!r}")
    job.shutdown()
