"""A SLURM 22.05 cluster of the two hosts: slurmctld on the first, one slurmd on each.

State, spool, logs and configuration live under one temporary directory.
Authentication is ``auth/none`` (no munge), processes are tracked without
cgroups (``proctrack/linuxproc``, ``task/none``), and there is no accounting.
Each slurmd reads its own copy of the configuration, with its own ``mpi.conf``:
the hosts share ``/tmp``, and ``srun --mpi=pmix`` needs a PMIx directory per node.
Clients (srun, sbatch, scontrol) find the cluster through ``SLURM_CONF``.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Sequence

from .hosts import Host, Started
from .jobs import HostProcess

DAEMONS = ("slurmctld", "slurmd", "srun", "sbatch", "scontrol", "sinfo")


def missing_daemons() -> List[str]:
    return [name for name in DAEMONS if shutil.which(name) is None]


class SlurmCluster(Started):
    def __init__(self, hosts: Sequence[Host], workdir: Path) -> None:
        self.hosts, self.dir = list(hosts), workdir
        self.conf = workdir / "slurm.conf"
        self.procs: List[HostProcess] = []

    def env(self) -> Dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def _config(self) -> str:
        head = self.hosts[0]
        nodes = "".join(f"NodeName={h.name} NodeAddr={h.addr} CPUs=2 State=UNKNOWN\n" for h in self.hosts)
        return (f"ClusterName=tbmh\nSlurmctldHost={head.name}({head.addr})\nSlurmUser=root\nSlurmdUser=root\n"
                "AuthType=auth/none\nCredType=cred/none\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
                "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\nJobAcctGatherType=jobacct_gather/none\n"
                "AccountingStorageType=accounting_storage/none\nMpiDefault=none\nReturnToService=2\n"
                "KillWait=5\nInactiveLimit=0\nMinJobAge=300\nSchedulerParameters=sched_interval=1\n"
                f"StateSaveLocation={self.dir}/state\nSlurmdSpoolDir={self.dir}/spool-%n\n"
                f"SlurmctldPidFile={self.dir}/slurmctld.pid\nSlurmdPidFile={self.dir}/slurmd-%n.pid\n"
                f"SlurmctldLogFile={self.dir}/slurmctld.log\nSlurmdLogFile={self.dir}/slurmd-%n.log\n"
                "SlurmctldPort=6817\nSlurmdPort=6818\n"
                f"{nodes}PartitionName=tbmh Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n")

    def _start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "state").mkdir(exist_ok=True)
        config = self._config()
        self.conf.write_text(config)
        env = {**os.environ, **self.env()}
        self.procs.append(HostProcess(self.hosts[0], ["slurmctld", "-D", "-i", "-f", str(self.conf)],
                                      self.dir / "slurmctld.out", env))
        for host in self.hosts:
            (self.dir / f"spool-{host.name}").mkdir(exist_ok=True)
            node_dir = self.dir / f"conf-{host.name}"
            pmix_dir = self.dir / f"pmix-{host.name}"
            node_dir.mkdir(exist_ok=True)
            pmix_dir.mkdir(exist_ok=True)
            (node_dir / "slurm.conf").write_text(config)
            (node_dir / "mpi.conf").write_text(f"PMIxCliTmpDirBase={pmix_dir}\n")
            self.procs.append(HostProcess(host, ["slurmd", "-D", "-N", host.name, "-f", str(node_dir / "slurm.conf")],
                                          self.dir / f"slurmd.{host.name}.out", env))
        self._wait_until_idle()

    def _wait_until_idle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            dead = [p for p in self.procs if p.poll() is not None]
            if dead:
                break
            probe = self.client(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=15)
            states = probe.stdout.strip()
            if probe.returncode == 0 and states.count("idle") == len(self.hosts):
                return
            time.sleep(0.3)
        raise RuntimeError(f"the SLURM cluster did not reach idle within {timeout}s (sinfo: {states!r})\n"
                           + "\n".join(p.describe() for p in self.procs)
                           + "".join(f"\n--- {log.name}\n{log.read_text()[-2000:]}"
                                     for log in self.dir.glob("*.log")))

    def client(self, argv: List[str], timeout: float) -> subprocess.CompletedProcess:
        """A SLURM client command (sinfo, scontrol, ...) run on the first host."""
        return subprocess.run(self.hosts[0].command(argv), capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env()})

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED")


def job_fields(text: str) -> Dict[str, str]:
    """``scontrol show job -o`` output as a dict (JobState, ExitCode, Restarts, ...)."""
    return dict(item.split("=", 1) for item in text.split() if "=" in item)


def submit(cluster: "SlurmCluster", argv: List[str], env: Dict[str, str], timeout: float = 30) -> int:
    """``sbatch --parsable ARGV`` on the first host; the job id."""
    result = subprocess.run(cluster.hosts[0].command(["sbatch", "--parsable", *argv]), capture_output=True,
                            text=True, timeout=timeout, env={**env, **cluster.env()})
    if result.returncode != 0:
        raise RuntimeError(f"sbatch {' '.join(argv)}: exit {result.returncode}: {result.stderr.strip()}")
    return int(result.stdout.strip().split(";")[0])


def job_state(cluster: "SlurmCluster", job_id: int) -> Dict[str, str]:
    return job_fields(cluster.client(["scontrol", "show", "job", "-o", str(job_id)], timeout=15).stdout)


def wait_job(cluster: "SlurmCluster", job_id: int, timeout: float) -> Dict[str, str]:
    """The job's fields once it ended (polled every 0.3 s: ``sbatch --wait`` sleeps up to 10 s);
    on timeout the job is cancelled and TimeoutError raised."""
    deadline = time.monotonic() + timeout
    while True:
        fields = job_state(cluster, job_id)
        if fields.get("JobState") in ENDED:
            return fields
        if time.monotonic() > deadline:
            cluster.client(["scancel", str(job_id)], timeout=15)
            raise TimeoutError(f"SLURM job {job_id} still {fields.get('JobState')} after {timeout}s (a hang)")
        time.sleep(0.3)
