"""Which launcher started this process: detected once, here, apart from the backend.

Detection order (first match wins):

1. ``torchelastic`` -- torchrun, and our ``--nproc`` spawner. First, because
   torchrun may itself run inside an srun or mpirun allocation.
2. ``horovodrun``   -- horovodrun in Gloo mode (HOROVOD_RANK/HOROVOD_SIZE).
3. ``mpi``          -- mpirun/mpiexec (Open MPI, MPICH), and horovodrun --mpi.
4. ``slurm``        -- an srun job step.
5. ``env_vars``     -- WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT set by hand (env://: Kubeflow, scripts).
6. plain python     -- one process.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping, Optional

from . import env_vars, horovodrun, mpi, slurm, torchelastic
from .environment import LaunchEnv
from .rendezvous import rendezvous_address

DETECTORS = (torchelastic, horovodrun, mpi, slurm, env_vars)


def report_error(message: str) -> None:
    """Print ``trainbridge: error: message`` as one line, and hand it to the launcher if it collects errors."""
    line = f"trainbridge: error: {message}"
    # One write: under PYTHONUNBUFFERED, print() writes the text and its newline apart, and another rank's
    # line, on the same stream, can land between them.
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    torchelastic.record_error(line)


def detect_launch(environ: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """The :class:`LaunchEnv` of this process, from its environment variables."""
    environ = os.environ if environ is None else environ
    for detector in DETECTORS:
        env = detector.detect(environ)
        if env is not None:
            return env
    return LaunchEnv(launcher="python")


__all__ = ["LaunchEnv", "detect_launch", "rendezvous_address", "report_error"]
