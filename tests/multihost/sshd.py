"""A test-only sshd on each host, and an ``ssh`` that trusts them, for horovodrun.

horovodrun reaches other hosts with plain ``ssh``. Each host runs ``sshd -D`` on
port 2222 with a host key and an authorized client key made here, and a wrapper
named ``ssh``, put first on PATH, adds a config that accepts those host keys
without writing anything to the user's own ``~/.ssh``.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import List, Sequence

from .hosts import Host, Started
from .jobs import HostProcess

PORT = 2222
SSHD = "/usr/sbin/sshd"


class SshdPerHost(Started):
    def __init__(self, hosts: Sequence[Host], workdir: Path) -> None:
        self.hosts, self.dir = list(hosts), workdir
        self.key = workdir / "client_key"
        self.bin = workdir / "bin"
        self.procs: List[HostProcess] = []

    def _start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for key in (self.key, self.dir / "host_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=30)
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
        for host in self.hosts:
            config = self.dir / f"sshd_config.{host.name}"
            config.write_text(f"Port {PORT}\nListenAddress {host.addr}\nHostKey {self.dir / 'host_key'}\n"
                              f"PidFile {self.dir / ('sshd.' + host.name + '.pid')}\n"
                              f"AuthorizedKeysFile {self.key}.pub\nUsePAM no\nStrictModes no\n"
                              "PasswordAuthentication no\nPermitRootLogin prohibit-password\n"
                              "AcceptEnv *\nPermitUserEnvironment no\n")
            self.procs.append(HostProcess(host, [SSHD, "-D", "-e", "-f", str(config)],
                                          self.dir / f"sshd.{host.name}.log", dict(os.environ)))
        client = self.dir / "ssh_config"
        client.write_text(f"Host *\n  Port {PORT}\n  IdentityFile {self.key}\n  StrictHostKeyChecking no\n"
                          "  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n")
        self.bin.mkdir(exist_ok=True)
        wrapper = self.bin / "ssh"
        wrapper.write_text(f"#!/bin/sh\nexec /usr/bin/ssh -F {client} \"$@\"\n")
        wrapper.chmod(0o755)
        self._wait_until_listening()

    def _wait_until_listening(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        for host in self.hosts:
            while True:
                probe = subprocess.run(host.command([str(self.bin / "ssh"), host.name, "true"]),
                                       capture_output=True, text=True, timeout=30)
                if probe.returncode == 0:
                    break
                dead = [p for p in self.procs if p.poll() is not None]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"test sshd on {host.name} does not answer: {probe.stderr.strip()}\n"
                                       + "\n".join(p.describe() for p in self.procs))
                time.sleep(0.2)

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()

    def horovodrun_flags(self) -> List[str]:
        return ["--ssh-port", str(PORT), "--ssh-identity-file", str(self.key)]

    def path(self) -> str:
        """PATH with the trusting ``ssh`` first."""
        return f"{self.bin}:{os.environ.get('PATH', '')}"
