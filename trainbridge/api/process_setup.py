"""What ``tb.init`` sets for the whole process before the job starts: printable output, intra-op
threads and deterministic GPU kernels (the heap settings are :mod:`trainbridge.launch.malloc_tuning`'s)."""

from __future__ import annotations

import os
import sys

import torch

from ..errors import UserError
from ..launch import LaunchEnv
from ..launch.environment import available_cores


def keep_output_printable() -> None:
    """Print what the encoding cannot hold as backslash escapes, not as a UnicodeEncodeError.

    A path that is not UTF-8 (``--output-dir $'runs\\xff'``) reaches Python as lone surrogates;
    under an ordinary UTF-8 locale stdout refuses them, and a finished run would die printing
    where it wrote. Python's stderr already escapes them; stdout does the same from here on.
    """
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")


def set_threads(requested: int, env: LaunchEnv) -> int:
    # torchrun pins every worker to 1 thread (with a warning) and Horovod sets
    # nothing, which leaves cores idle or oversubscribed.
    if requested < 0:
        raise UserError(f"threads must be at least 0 (got {requested})")
    threads = requested or max(1, available_cores() // max(1, env.local_size))
    torch.set_num_threads(threads)
    return threads


def use_deterministic_kernels() -> None:
    # Some GPU kernels sum in an order that changes from run to run (cuDNN's atomic
    # adds, cuBLAS's split reductions), so the last bits of the weights differ between
    # two runs and between a run and its resume. Before any CUDA work: cuBLAS reads its
    # workspace setting when it starts. An operation with no deterministic kernel warns.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)
