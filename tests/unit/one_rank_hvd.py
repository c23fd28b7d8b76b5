"""``trainbridge.hvd`` in a one-rank job in the test process, with the Horovod variables a test gives."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist
from one_rank_job import one_rank_env

import trainbridge.hvd as hvd
from trainbridge.hvd import process
from trainbridge.hvd.engine import Engine
from trainbridge.hvd.running_job import runtime


@contextlib.contextmanager
def hvd_job(**variables: str) -> Iterator[Engine]:
    """``hvd.init()`` with ``variables`` set, for the block; then ``hvd.shutdown()`` and no process group left."""
    with one_rank_env() as env:
        for name, value in variables.items():
            env.setenv(name, value)
        hvd.init()
        try:
            yield runtime().engine
        finally:
            hvd.shutdown()
            if process._owns_default_group and dist.is_initialized():
                dist.destroy_process_group()
            process._owns_default_group = False
