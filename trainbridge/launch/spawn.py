"""``python -m trainbridge.train --nproc N``: start N local workers without a launcher.

The parent picks a free port and starts N processes with torch.multiprocessing
("spawn"). Each worker exports the same variables torchrun would (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT)
plus TRAINBRIDGE_SPAWNED=1, so launcher detection reports "spawn". If any
worker fails, the others are terminated and the parent exits with its code.
"""
from __future__ import annotations

import os
import sys
from typing import Callable

import torch.multiprocessing as mp

from .rendezvous import free_port


def _worker(local_rank: int, nproc: int, port: int, target: Callable[[], int]) -> None:
    os.environ.update({
        "TRAINBRIDGE_SPAWNED": "1", "RANK": str(local_rank), "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    code = target()
    if code:
        raise SystemExit(code)


def spawn_workers(nproc: int, target: Callable[[], int]) -> int:
    """Run ``target()`` in ``nproc`` fresh processes; the first non-zero exit code, else 0."""
    try:
        mp.start_processes(_worker, args=(nproc, free_port(), target), nprocs=nproc, start_method="spawn")
    except mp.ProcessExitedException as exc:
        return exc.exit_code or 1
    except mp.ProcessRaisedException as exc:
        print(f"trainbridge: error: a spawned worker failed: {str(exc).strip().splitlines()[-1]}", file=sys.stderr)
        return 1
    return 0

