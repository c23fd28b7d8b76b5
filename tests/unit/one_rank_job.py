"""A one-rank job in the test process itself: torch.distributed's gloo group on loopback,
started through the ``env://`` variables (RANK=0, WORLD_SIZE=1, ...), as a launcher would.

``tb.init`` changes the whole process (``sys.excepthook``, the SIGTERM, SIGINT and SIGHUP handlers,
intra-op threads) and joins one process group at a time: :func:`one_rank_job` puts all of it back
when the block ends, so that a module-scoped fixture can share one job among its tests.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from conftest import inherited_launcher_variables

import trainbridge as tb
from trainbridge.api.stop import STOP_SIGNALS
from trainbridge.launch.rendezvous import free_port


@contextlib.contextmanager
def one_rank_env() -> Iterator[pytest.MonkeyPatch]:
    """The environment of rank 0 of a one-process ``env://`` job on a free port, with no other launcher's variables."""
    with pytest.MonkeyPatch.context() as env:
        for name in inherited_launcher_variables(dict(os.environ)):
            env.delenv(name)
        env.setenv("RANK", "0")
        env.setenv("WORLD_SIZE", "1")
        env.setenv("LOCAL_RANK", "0")
        env.setenv("MASTER_ADDR", "127.0.0.1")
        env.setenv("MASTER_PORT", str(free_port()))
        yield env


@contextlib.contextmanager
def one_rank_job(**init_options) -> Iterator[tb.Job]:
    """``tb.init(backend="torch")`` for the block; then ``job.shutdown()`` and the process as it was."""
    hook, threads = sys.excepthook, torch.get_num_threads()
    handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    try:
        with one_rank_env():
            job = tb.init(backend="torch", timeout=60.0, malloc_tuning="off", **init_options)
            try:
                yield job
            finally:
                job.shutdown()
    finally:
        sys.excepthook = hook
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        torch.set_num_threads(threads)
        assert not dist.is_initialized()
