"""``python -m trainbridge.train --nproc N``: start N local workers without a launcher.

The parent picks a free port and starts N processes with torch.multiprocessing
("spawn"). Each worker exports the same variables torchrun would (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT)
plus TRAINBRIDGE_SPAWNED=1, so launcher detection reports "spawn". If any
worker fails, the others are terminated and the parent exits with its code.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Callable, Sequence

import torch.multiprocessing as mp

from .rendezvous import free_port

STOP_GRACE_SECONDS = 60.0  # after Ctrl-C: time for a stop checkpoint before the workers are killed


def _worker(local_rank: int, nproc: int, port: int, target: Callable[[], int]) -> None:
    os.environ.update(
        {
            "TRAINBRIDGE_SPAWNED": "1",
            "RANK": str(local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    code = target()
    if code:
        raise SystemExit(code)


def spawn_workers(nproc: int, target: Callable[[], int]) -> int:
    """Run ``target()`` in ``nproc`` fresh processes; the first non-zero exit code, else 0 (130 on Ctrl-C)."""
    # Ctrl-C reaches every process of the terminal's group. The workers ignore it (a disposition
    # set before they start holds through their start-up): the parent alone answers it, with the
    # SIGTERM that the job's stop agreement answers, so each worker leaves in order, once.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        context = mp.start_processes(
            _worker, args=(nproc, free_port(), target), nprocs=nproc, join=False, start_method="spawn"
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        while not context.join():
            pass
    except KeyboardInterrupt:
        return _stop_workers(context.processes)
    except mp.ProcessExitedException as exc:
        return exc.exit_code or 1
    except mp.ProcessRaisedException as exc:  # a bug, not bad input (that is one line, from the worker)
        trace = str(exc).strip().splitlines()
        print(
            f"trainbridge: error: spawned worker {exc.error_index} failed: {trace[-1]}; its traceback:",
            *trace[1:],
            sep="\n",
            file=sys.stderr,
        )
        return 1
    return 0


def _stop_workers(processes: Sequence[mp.Process]) -> int:
    print(
        f"trainbridge: interrupted: stopping the {len(processes)} workers (a loop that calls job.should_stop() "
        f"saves its stop checkpoint first; Ctrl-C again kills them)",
        file=sys.stderr,
        flush=True,
    )
    for process in processes:
        if process.is_alive():
            process.terminate()
    try:
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:
        pass
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    return 130  # 128 + SIGINT, as a shell reports an interrupted command
