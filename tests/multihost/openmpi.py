"""Open MPI across the two hosts without ssh: an rsh agent that enters the named host.

mpirun starts its daemon (orted) on each remote host by running
``AGENT HOST COMMAND...``; COMMAND is one shell string split into words. The
agent runs it with ``bash -c`` on that host (its namespace, host name and hosts
file). The daemons inherit mpirun's environment, as they would from a shared
login profile.
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import List, Sequence

from .hosts import CIDR, Host


def write_rsh_agent(hosts: Sequence[Host], path: Path) -> Path:
    def case(h: Host) -> str:
        command = " ".join(shlex.quote(w) for w in h.command(["bash", "-c"]))
        return f"    {shlex.quote(h.name)}|{h.addr}) exec {command} \"$*\" ;;\n"

    cases = "".join(case(h) for h in hosts)
    path.write_text("#!/bin/bash\n# Open MPI rsh agent for the two-host tests: AGENT HOST COMMAND...\n"
                    "host=$1; shift\n"
                    "case \"$host\" in\n" + cases +
                    "    *) echo \"rsh agent: unknown host $host\" >&2; exit 255 ;;\nesac\n")
    path.chmod(0o755)
    return path


def mpirun_flags(hosts: Sequence[Host], agent: Path) -> List[str]:
    """mpirun options for one rank on each host, over the hosts' subnet only."""
    return ["--allow-run-as-root", "--bind-to", "none", "-np", str(len(hosts)),
            "-H", ",".join(f"{h.name}:1" for h in hosts), "--mca", "plm_rsh_agent", str(agent),
            "--mca", "btl_tcp_if_include", CIDR, "--mca", "oob_tcp_if_include", CIDR]
