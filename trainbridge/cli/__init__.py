"""The ``trainbridge`` console script: ``train``, ``doctor``, ``data``, ``export`` and ``build-horovod``.

The peer bench is not a command of the installed package: it runs from a source checkout
(``python -m benchmarks``), beside the baselines it compares with."""

from __future__ import annotations

import sys
from typing import List, Optional

USAGE = """usage: trainbridge <command> [options]
       trainbridge --version

commands:
  train    train a model (same options as python -m trainbridge.train; --help for them)
  doctor   versions, collective libraries, the detected launcher; --hosts A,B checks a multi-node set-up
  data     make-sample designsafe --out DIR: write a small synthetic DesignSafe-style image folder
  export   CHECKPOINT OUTPUT: a sharded checkpoint's model as one plain state_dict file
  build-horovod  build Horovod against this torch and install it (Horovod 0.28.1 needs a fix to build)
"""


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from ..version import __version__

        print(f"trainbridge {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        from ..api import exit_process
        from .train import main as train_main

        exit_process(train_main(rest))
    if command == "doctor":
        from .doctor import main as doctor_main

        return doctor_main(rest)
    if command == "data":
        from .data import main as data_main

        return data_main(rest)
    if command == "export":
        from .export import main as export_main

        return export_main(rest)
    if command == "build-horovod":
        from .build_horovod import main as build_horovod_main

        return build_horovod_main(rest)
    print(
        f"trainbridge: error: unknown command {command!r}; use train, doctor, data, export or build-horovod",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
