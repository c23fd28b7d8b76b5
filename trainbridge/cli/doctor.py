"""``trainbridge doctor``: what this machine can run, and what launched this process."""
from __future__ import annotations

import importlib.metadata
import shutil
from typing import List, Tuple

import torch
import torch.distributed as dist

from ..launch import detect_launch


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def horovod_build() -> List[Tuple[str, str]]:
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        return [("horovod.torch", f"unavailable ({exc})")]
    yes = {True: "yes", False: "no"}
    return [
        ("horovod frameworks", "PyTorch"),  # importing horovod.torch proves the PyTorch extension
        ("horovod controllers", ", ".join(n for n, ok in (("MPI", hvd.mpi_built()), ("Gloo", hvd.gloo_built())) if ok) or "none"),
        ("horovod tensor ops", ", ".join(n for n, ok in (("MPI", hvd.mpi_built()), ("Gloo", hvd.gloo_built()),
                                                           ("NCCL", hvd.nccl_built()), ("DDL", hvd.ddl_built()),
                                                           ("CCL", hvd.ccl_built())) if ok) or "none"),
        ("horovod CUDA", yes[bool(hvd.cuda_built())]),
    ]


def report() -> List[Tuple[str, str]]:
    yes = {True: "yes", False: "no"}
    env = detect_launch()
    try:
        import torchvision  # noqa: F401
        tv = version("torchvision")
    except Exception as exc:  # noqa: BLE001 - report, never crash the doctor
        tv = f"{version('torchvision')} (import fails: {exc})"
    rows = [
        ("torch", torch.__version__),
        ("torchvision", tv),
        ("horovod", version("horovod")),
        ("mpi4py", version("mpi4py")),
        ("CUDA available", yes[torch.cuda.is_available()] + (f" ({torch.cuda.device_count()} GPU)" if torch.cuda.is_available() else "")),
        ("NCCL (torch)", yes[dist.is_nccl_available()]),
        ("Gloo (torch)", yes[dist.is_gloo_available()]),
        ("MPI (torch)", yes[dist.is_mpi_available()]),
        ("mpirun", shutil.which("mpirun") or "not found"),
        ("torchrun", shutil.which("torchrun") or "not found"),
        ("horovodrun", shutil.which("horovodrun") or "not found"),
    ]
    rows += horovod_build()
    rows.append(("launcher", f"{env.launcher} (rank {env.rank} of {env.world_size}, local rank {env.local_rank} of {env.local_size})"))
    return rows


def main() -> int:
    rows = report()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0
