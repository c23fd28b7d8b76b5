"""``python -m trainbridge.train``: the same as ``trainbridge train`` (see :mod:`trainbridge.cli.train`)."""

from .api import exit_process
from .cli.train import main

if __name__ == "__main__":
    exit_process(main())
