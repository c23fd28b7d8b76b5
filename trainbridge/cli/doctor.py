"""``trainbridge doctor``: what this machine can run, and what launched this process.

``trainbridge doctor --hosts a,b [--rdzv-endpoint HOST:PORT] [--master-addr ADDR --master-port PORT]``
also checks a job across those hosts before it starts (:mod:`trainbridge.launch.host_checks`),
printing one line per problem with its fix, and exits 1 when it found any. The
interface names of the other hosts are read over ssh (as horovodrun would reach them).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..backends.horovod import HOROVOD_FIX, horovod_problem
from ..launch import detect_launch
from ..optional import OPTIONAL
from ..version import __version__

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # trainbridge/cli/doctor.py -> trainbridge


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def horovod_build() -> List[Tuple[str, str]]:
    problem = horovod_problem()
    if problem is not None:
        return [("horovod.torch", f"unusable: {problem}; {HOROVOD_FIX}")]
    import horovod.torch as hvd

    yes = {True: "yes", False: "no"}
    return [
        ("horovod frameworks", "PyTorch"),  # importing horovod.torch proves the PyTorch extension
        (
            "horovod controllers",
            ", ".join(n for n, ok in (("MPI", hvd.mpi_built()), ("Gloo", hvd.gloo_built())) if ok) or "none",
        ),
        (
            "horovod tensor ops",
            ", ".join(
                n
                for n, ok in (
                    ("MPI", hvd.mpi_built()),
                    ("Gloo", hvd.gloo_built()),
                    ("NCCL", hvd.nccl_built()),
                    ("DDL", hvd.ddl_built()),
                    ("CCL", hvd.ccl_built()),
                )
                if ok
            )
            or "none",
        ),
        ("horovod CUDA", yes[bool(hvd.cuda_built())]),
    ]


def missing_optional() -> str:
    """The optional packages (:mod:`trainbridge.optional`) not installed here, each with the extra that adds it."""
    missing = [
        f'{package} (pip install "trainbridge[{extra}]")'
        for module, (package, extra) in OPTIONAL.items()
        if importlib.util.find_spec(module) is None
    ]
    return "missing: " + ", ".join(missing) if missing else "all installed"


def report() -> List[Tuple[str, str]]:
    yes = {True: "yes", False: "no"}
    env = detect_launch()
    try:
        import torchvision  # noqa: F401

        tv = version("torchvision")
    except Exception as exc:  # noqa: BLE001 - report, never crash the doctor
        tv = f"{version('torchvision')} (import fails: {exc})"
    rows = [
        ("trainbridge", f"{__version__} ({PACKAGE_DIR})"),
        ("torch", torch.__version__),
        ("torchvision", tv),
        ("horovod", version("horovod")),
        ("mpi4py", version("mpi4py")),
        (
            "CUDA available",
            yes[torch.cuda.is_available()]
            + (f" ({torch.cuda.device_count()} GPU)" if torch.cuda.is_available() else ""),
        ),
        ("NCCL (torch)", yes[dist.is_nccl_available()]),
        ("Gloo (torch)", yes[dist.is_gloo_available()]),
        ("MPI (torch)", yes[dist.is_mpi_available()]),
        ("mpirun", shutil.which("mpirun") or "not found"),
        ("torchrun", shutil.which("torchrun") or "not found"),
        ("horovodrun", shutil.which("horovodrun") or "not found"),
    ]
    rows += horovod_build()
    rows.append(("optional packages", missing_optional()))
    rows.append(
        (
            "launcher",
            f"{env.launcher} (rank {env.rank} of {env.world_size}, local rank {env.local_rank} of {env.local_size})",
        )
    )
    return rows


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="trainbridge doctor", description=__doc__.splitlines()[0])
    p.add_argument("--hosts", help="comma-separated host names of a job across hosts: check them before it starts")
    p.add_argument("--rdzv-endpoint", help="torchrun's c10d --rdzv-endpoint HOST:PORT to check")
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR"), help="default: $MASTER_ADDR")
    p.add_argument(
        "--master-port", type=int, default=int(os.environ.get("MASTER_PORT") or 0) or None, help="default: $MASTER_PORT"
    )
    p.add_argument("--ssh-port", type=int, default=None, help="for reading the other hosts' interfaces")
    p.add_argument("--route-to", metavar="ADDR", help=argparse.SUPPRESS)  # used over ssh: the interface towards ADDR
    return p.parse_args(list(argv))


def is_this_host(host: str) -> bool:
    from ..launch.network import interface_addresses, resolve

    own = {a for addrs in interface_addresses(up_only=False).values() for a in addrs}
    return host in (socket.gethostname(), socket.getfqdn()) or bool(set(resolve(host)) & (own - {"127.0.0.1"}))


def ssh_command(host: str, ssh_port: Optional[int], me: str) -> List[str]:
    """ssh to ``host`` running ``doctor --route-to me`` there; the host comes after ``--``, so that a
    name like ``-oProxyCommand=...`` is read as a host (that resolves nowhere), never as an option."""
    port = ["-p", str(ssh_port)] if ssh_port else []
    remote = [sys.executable, "-m", "trainbridge", "doctor", "--route-to", me]
    return ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", *port, "--", host, *remote]


def remote_interface(host: str, ssh_port: Optional[int]) -> Tuple[Optional[str], Optional[str]]:
    """(interface name on ``host`` towards this host, or None; why not)."""
    from ..launch.network import source_address_towards

    me = source_address_towards(host)
    if me is None:
        return None, f"no route to {host}"
    try:
        result = subprocess.run(ssh_command(host, ssh_port, me), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, str(exc)
    if result.returncode != 0 or not result.stdout.strip():
        return None, (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
    return result.stdout.split()[0], None


def host_problems(args: argparse.Namespace) -> Tuple[List[str], List[str]]:
    """(problems, notes) for a job across ``args.hosts``."""
    from ..launch import host_checks
    from ..launch.network import gloo_interface_for

    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    # A name that starts with "-" is an option to ssh and to every launcher: never passed on.
    problems = [
        f"{h!r} is not a host name: it starts with '-', which ssh and the launchers read as an option; "
        f"list host names separated by commas"
        for h in hosts
        if h.startswith("-")
    ]
    hosts = [h for h in hosts if not h.startswith("-")]
    problems += host_checks.check_own_name(hosts) + host_checks.check_host_names(hosts)
    notes: List[str] = []
    interfaces: Dict[str, Optional[str]] = {}
    for host in hosts:
        if is_this_host(host):
            others = [h for h in hosts if not is_this_host(h)]
            interfaces[host] = gloo_interface_for(others[0]) if others else None
        else:
            interfaces[host], why = remote_interface(host, args.ssh_port)
            if why:
                notes.append(f"interface of {host} unknown (ssh: {why}): its name was not compared")
    notes.append("interfaces towards the other hosts: " + ", ".join(f"{h} {i or '?'}" for h, i in interfaces.items()))
    problems += host_checks.check_interfaces(interfaces)
    if args.rdzv_endpoint:
        problems += host_checks.check_rendezvous_endpoint(args.rdzv_endpoint, hosts)
    if args.master_addr:
        problems += host_checks.check_master_addr(args.master_addr, args.master_port, hosts)
    return problems, notes


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.route_to:
        from ..launch.network import gloo_interface_for

        print(gloo_interface_for(args.route_to) or "")
        return 0
    rows = report()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    if not args.hosts:
        return 0
    problems, notes = host_problems(args)
    for note in notes:
        print(f"hosts: {note}")
    for problem in problems:
        print(f"problem: {problem}")
    print(f"hosts: {len(problems)} problem(s) found" if problems else "hosts: no problem found")
    return 1 if problems else 0
