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
from typing import List, NoReturn, Optional

from ..api import exit_process, init, report_failure
from ..errors import UserError
from ..launch import detect_launch, report_error
from ..launch.spawn import spawn_workers
from ..training.checkpoint import claim_output_dir
from ..training.config import TrainConfig, parse_config
from ..training.fault_tolerance import PREEMPTED_EXIT_CODE, Preempted
from ..training.loop import train
from .flags import cli_error


def run_worker(cfg: TrainConfig) -> int:
    """Train in this process as one rank of the job; returns the exit status."""
    job, finished = None, False
    try:
        cfg.validate()
        job = init(
            cfg.backend,
            timeout=cfg.timeout,
            dist_backend=cfg.dist_backend,
            threads=cfg.threads,
            malloc_tuning=cfg.malloc_tuning,
            deterministic=cfg.deterministic,
        )
        claim_output_dir(cfg.output_dir, job)  # one job per --output-dir, before anything there is read or moved
        train(cfg, job)
        finished = True
        return 0
    except Preempted as exc:
        assert job is not None  # raised by the loop, which runs in a job
        job.print(f"[trainbridge] {exc}")
        finished = True  # every rank stopped at the same step: leave together
        return PREEMPTED_EXIT_CODE
    except Exception as exc:  # noqa: BLE001 - bad input and peer failures become one line; bugs keep their traceback
        code = report_failure(cli_error(exc))
        if code is None:
            raise
        return code
    finally:
        if job is not None:
            job.shutdown(clean=finished)


def run_spawned_worker(cfg: TrainConfig) -> NoReturn:
    """One rank started by ``--nproc``: it ends as a launched rank does (``exit_process``), not
    through the interpreter's teardown (see ``leave_after_failure``)."""
    exit_process(run_worker(cfg))


def main(argv: Optional[List[str]] = None) -> int:
    try:
        cfg = parse_config(argv)
    except UserError as exc:  # an unknown or unloadable --task
        report_error(str(exc))
        return 2
    if cfg.nproc > 1:
        if detect_launch().launcher != "python":
            report_error(
                "--nproc is for plain python; under a launcher set the process count there "
                "(torchrun --nproc-per-node, horovodrun -np, mpirun -np)"
            )
            return 2
        return spawn_workers(cfg.nproc, functools.partial(run_spawned_worker, cfg))
    return run_worker(cfg)


if __name__ == "__main__":
    exit_process(main())
