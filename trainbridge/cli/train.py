"""Entry point: ``python -m trainbridge.train [options]`` under any launcher.

Examples::

    python -m trainbridge.train                           # one process (local backend)
    python -m trainbridge.train --nproc 2                 # two local workers, torch backend
    torchrun --nproc-per-node 2 -m trainbridge.train      # DDP
    horovodrun -np 2 python -m trainbridge.train          # Horovod
    mpirun -np 2 python -m trainbridge.train              # Horovod (or torch with --backend torch)

Bad input ends with one line ``trainbridge: error: ...`` on stderr and exit status 2.
"""
from __future__ import annotations

import functools
import gc
import os
import sys
import time
from typing import List, Optional

import torch

from ..backends import create_backend
from ..training.config import TrainConfig, parse_config
from ..errors import UserError
from ..training.fault_tolerance import PREEMPTED_EXIT_CODE, Preempted
from ..launch import detect_launch, report_error
from ..launch.rendezvous import finalize_mpi
from ..launch.spawn import spawn_workers
from ..launch.malloc_tuning import tune_malloc


QUIET_RANK_GRACE_SECONDS = 10.0


def set_threads(requested: int, local_size: int) -> int:
    """Intra-op threads per rank: the available cores shared among local processes.

    torchrun pins every worker to 1 thread (with a warning) and Horovod sets
    nothing, which leaves cores idle or oversubscribed.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = requested or max(1, cores // max(1, local_size))
    torch.set_num_threads(threads)
    return threads


def run_worker(cfg: TrainConfig) -> int:
    """Train in this process as one rank of the job; returns the exit status."""
    from ..training.loop import train

    env = detect_launch()
    backend, finished = None, False
    try:
        cfg.validate()
        threads = set_threads(cfg.threads, env.local_size)
        # Before the data and the model exist, so that every buffer comes from the tuned heap.
        tuned, why = tune_malloc(cfg.malloc_tuning, os.environ)
        backend = create_backend(cfg.backend, env, dist_backend=cfg.dist_backend, timeout=cfg.timeout)
        backend.init()
        backend.print(f"[trainbridge] threads per rank: {threads}; malloc {'tuned' if tuned else 'left as is'}: {why}")
        train(cfg, backend)
        finished = True
        return 0
    except UserError as exc:
        # Input and launcher errors are the same on every rank: one line from rank 0
        # is enough. The other ranks give rank 0 time to report first (a launcher
        # kills the rest of the job on the first exit) and speak only if still
        # alive, i.e. when the error was theirs alone. Once the backend exists, an
        # error may be one rank's: each reports.
        if (backend is None and env.rank != 0) or exc.quiet:
            time.sleep(QUIET_RANK_GRACE_SECONDS)
        if not exc.quiet:
            report_error(str(exc))
        return 2
    except Preempted as exc:
        if env.rank == 0:
            print(f"[trainbridge] {exc}", flush=True)
        finished = True  # every rank stopped at the same step: leave together
        return PREEMPTED_EXIT_CODE
    except Exception as exc:  # noqa: BLE001 - only peer failures become one line; bugs keep their traceback
        message = backend.describe_failure(exc) if backend is not None else None
        if message is None:
            raise
        report_error(message)
        return 1
    finally:
        if backend is not None:
            backend.shutdown(clean=finished)


def main(argv: Optional[List[str]] = None) -> int:
    cfg = parse_config(argv)
    if cfg.nproc > 1:
        if detect_launch().launcher != "python":
            report_error("--nproc is for plain python; under a launcher set the process count there "
                         "(torchrun --nproc-per-node, horovodrun -np, mpirun -np)")
            return 2
        return spawn_workers(cfg.nproc, functools.partial(run_worker, cfg))
    return run_worker(cfg)


def exit_process(code: int) -> None:
    """Exit with ``code`` once the work is done, skipping the interpreter's C++ teardown.

    After a clean shutdown of the process group, gloo and the rendezvous store can
    still hold helper threads in static objects; destroying them at interpreter exit
    sometimes aborts the process ("terminate called without an active exception",
    SIGABRT), which a launcher reports as a failed rank. Everything this process
    owes the job (checkpoints, metrics, the shutdown barrier) is finished here, so
    flush and leave directly (after a collection, so DataLoader workers are shut down).
    A failed rank skips MPI_Finalize, which could wait on peers that are gone; mpirun
    then reports it as failed, as it should.
    """
    gc.collect()
    if code == 0:
        finalize_mpi()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_process(main())
