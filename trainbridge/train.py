"""``python -m trainbridge.train``: the same as ``trainbridge train`` (see :mod:`trainbridge.cli.train`)."""
from .cli.train import exit_process, main

if __name__ == "__main__":
    exit_process(main())
