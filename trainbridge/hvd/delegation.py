"""Whether this process should use the real ``horovod.torch`` instead of the torch backend.

Decided once, at import, from the launcher (see :mod:`trainbridge.launch`):

=========================  ==================================================
started by                 ``import trainbridge.hvd as hvd`` is
=========================  ==================================================
horovodrun (gloo mode)     the real horovod.torch (HOROVOD_RANK is set)
horovodrun --mpi           the real horovod.torch (see below)
mpirun / mpiexec           the torch backend: torch.distributed over gloo/nccl,
                           rendezvous agreed through mpi4py
torchrun, srun, spawn      the torch backend
plain python               the torch backend with a one-process group
=========================  ==================================================

``horovodrun --mpi`` exports nothing of its own: it runs mpirun with
``-mca pml ob1 -mca btl ^openib --tag-output`` (horovod.runner.mpi_run), which
reach the workers as OMPI_MCA_* variables, and on the launching node it is an
ancestor process. Either sign counts. ``TRAINBRIDGE_HVD_BACKEND=horovod|torch``
overrides the choice (e.g. to use the real Horovod under a bare mpirun), except
that ``horovod`` is refused under torchrun (and trainbridge's spawn, and env://)
with the same line as ``--backend horovod`` there
(:func:`trainbridge.backends.horovod.refuse_horovod_under`): Horovod ignores their
variables, so each process would be a job of size 1, training alone.
"""

from __future__ import annotations

import os
from typing import Iterator, Mapping, Optional

from ..backends.horovod import refuse_horovod_under
from ..errors import UserError
from ..launch import detect_launch

HOROVODRUN_MPI_FLAGS = {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "^openib", "OMPI_MCA_orte_tag_output": "1"}


def ancestor_commands(pid: Optional[int] = None) -> Iterator[str]:
    """Command lines of this process's ancestors (Linux /proc; nothing elsewhere)."""
    pid = os.getppid() if pid is None else pid
    for _ in range(16):
        if pid <= 1:
            return
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                yield f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return


def started_by_horovodrun_mpi(environ: Mapping[str, str]) -> bool:
    if all(environ.get(k) == v for k, v in HOROVODRUN_MPI_FLAGS.items()):
        return True
    return any("horovodrun" in command for command in ancestor_commands())


def use_real_horovod(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``import trainbridge.hvd`` becomes the real ``horovod.torch`` for ``environ``.

    True under horovodrun (Gloo or ``--mpi``); ``TRAINBRIDGE_HVD_BACKEND=horovod`` or ``torch``
    overrides the choice, and a choice that cannot work (horovod under torchrun) is a ``UserError``.
    """
    environ = os.environ if environ is None else environ
    override = environ.get("TRAINBRIDGE_HVD_BACKEND")
    if override:
        if override not in ("horovod", "torch"):
            raise UserError(f"TRAINBRIDGE_HVD_BACKEND={override!r}: use 'horovod' or 'torch'")
        env = detect_launch(environ)
        if override == "horovod":
            refuse_horovod_under(
                env,
                "TRAINBRIDGE_HVD_BACKEND=horovod",
                f"unset TRAINBRIDGE_HVD_BACKEND under {env.launcher} (trainbridge.hvd then runs on torch.distributed)",
            )
        return override == "horovod"
    launcher = detect_launch(environ).launcher
    return launcher == "horovodrun" or (launcher == "mpirun" and started_by_horovodrun_mpi(environ))
