"""Two "hosts" on one machine: network namespaces joined by a veth pair.

Each host has its own network namespace (one end of the veth pair, renamed
``tbv0`` on both so that Horovod finds the same interface everywhere, plus
``lo``), its own UTS host name and its own hosts file, bind-mounted over
``/etc/hosts`` in a private mount namespace only for the commands run "on" it.
The machine's own ``/etc/hosts``, host name and interfaces are never touched,
and only addresses inside the namespaces made here are used.

Commands enter a host with ``nsenter --net`` plus ``unshare --mount --uts``
rather than ``ip netns exec``, which remounts ``/sys`` and hides the cgroup
filesystem that slurmd needs.

Every namespace, link and process made here carries :data:`PREFIX` in its name,
so :func:`remove_leftovers` can clear what a crashed run left behind.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

PREFIX = "tbmh"  # trainbridge multi-host: namespaces tbmh-<pid>-<n>, veth ends tbmh<pid>h<n>
SUBNET = "10.77.0"  # only inside the namespaces made here
CIDR = f"{SUBNET}.0/24"
IFACE = "tbv0"  # the same interface name on every host
TOOLS = ("ip", "nsenter", "unshare", "mount", "hostname")


def missing_requirements() -> Optional[str]:
    """Why two hosts cannot be made on this machine, or None."""
    if os.geteuid() != 0:
        return "the two-host tests need root (network namespaces, veth pairs, bind mounts)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"the two-host tests need iproute2 and util-linux; not found: {', '.join(missing)}"
    return None


class Started:
    """A context manager that always undoes what it started, also when starting fails half-way."""

    def __enter__(self):
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Host:
    name: str        # its UTS host name, resolvable on every host through the hosts files
    netns: str       # its network namespace (/run/netns/<netns>)
    addr: str        # its address on the veth link
    hosts_file: Path  # bind-mounted over /etc/hosts for commands run on it

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"

    def command(self, argv: Sequence[str]) -> List[str]:
        """``argv`` run on this host: its network namespace, host name and hosts file."""
        enter = (f"mount --bind {shlex.quote(str(self.hosts_file))} /etc/hosts && "
                 f"hostname {shlex.quote(self.name)} && exec \"$@\"")
        return ["nsenter", f"--net={self.netns_path}", "unshare", "--mount", "--uts", "--propagation", "private",
                "sh", "-c", enter, "sh", *argv]

    def shell(self, script: str) -> List[str]:
        """A shell script run on this host."""
        return self.command(["bash", "-c", script])

    def pids(self) -> List[int]:
        """Every process whose network namespace is this host's."""
        try:
            target = os.stat(self.netns_path).st_ino
        except FileNotFoundError:
            return []
        return namespace_pids(target)


def namespace_pids(netns_inode: int) -> List[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/net").st_ino == netns_inode:
                pids.append(int(entry))
        except OSError:
            continue
    return pids


def kill_pids(pids: Sequence[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def remove_namespace(netns: str) -> None:
    """Kill every process in ``netns`` and delete it (the veth pair goes with it)."""
    path = f"/run/netns/{netns}"
    if os.path.exists(path):
        inode = os.stat(path).st_ino
        for _ in range(50):
            pids = namespace_pids(inode)
            if not pids:
                break
            kill_pids(pids)
            time.sleep(0.1)
    ip("netns", "delete", netns, check=False)


def creator_alive(name: str) -> bool:
    """Whether the process that made ``name`` (tbmh-<pid>-N or tbmh<pid>hN) still runs: then it is not a leftover."""
    match = re.match(rf"{PREFIX}-?(\d+)", name)
    if not match:
        return False
    try:
        os.kill(int(match.group(1)), 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def remove_leftovers() -> List[str]:
    """Remove namespaces and links with :data:`PREFIX` that a crashed run left; returns their names.

    Those of a test run still going (its process alive) are left alone.
    """
    removed = []
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(PREFIX + "-") and not creator_alive(name):
            remove_namespace(name)
            removed.append(name)
    for line in ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        link = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        if link.startswith(PREFIX) and not creator_alive(link):
            ip("link", "delete", link, check=False)
            removed.append(link)
    return removed


class TwoHosts(Started):
    """Host ``tbnode1`` (10.77.0.1) and host ``tbnode2`` (10.77.0.2), joined by one veth pair.

    Use as a context manager: everything is removed on exit, also after a failure.
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        tag = f"{PREFIX}-{os.getpid()}"
        self.hosts = [Host(name=f"tbnode{n}", netns=f"{tag}-{n}", addr=f"{SUBNET}.{n}",
                           hosts_file=workdir / f"hosts.tbnode{n}") for n in (1, 2)]
        self._veth = [f"{PREFIX}{os.getpid()}h{n}"[:15] for n in (1, 2)]

    def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        table = "".join(f"{h.addr}\t{h.name}\n" for h in self.hosts)
        for host in self.hosts:
            # Each host's own file: localhost is loopback, every host name its veth address.
            host.hosts_file.write_text(f"127.0.0.1\tlocalhost\n::1\tlocalhost\n{table}")
            ip("netns", "add", host.netns)
        ip("link", "add", self._veth[0], "type", "veth", "peer", "name", self._veth[1])
        for host, veth in zip(self.hosts, self._veth):
            ip("link", "set", veth, "netns", host.netns)
            ns = ("-n", host.netns)
            ip(*ns, "link", "set", veth, "name", IFACE)
            ip(*ns, "addr", "add", f"{host.addr}/24", "dev", IFACE)
            ip(*ns, "link", "set", IFACE, "up")
            ip(*ns, "link", "set", "lo", "up")

    def stop(self) -> None:
        for host in self.hosts:
            remove_namespace(host.netns)
        for veth in self._veth:  # only there if creation stopped half-way
            if ip("link", "show", veth, check=False).returncode == 0:
                ip("link", "delete", veth, check=False)

    def set_link(self, host: Host, up: bool) -> None:
        """Take ``host``'s end of the link down (a cut cable) or up again."""
        ip("-n", host.netns, "link", "set", IFACE, "up" if up else "down")

    def rename_link(self, host: Host, old: str, new: str) -> None:
        """Give ``host``'s end of the link another name (its address stays)."""
        ns = ("-n", host.netns)
        ip(*ns, "link", "set", old, "down")
        ip(*ns, "link", "set", old, "name", new)
        ip(*ns, "link", "set", new, "up")


def run_on(host: Host, argv: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None,
           cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    """Run ``argv`` on ``host`` and wait; on timeout kill its process group and raise."""
    proc = subprocess.Popen(host.command(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise TimeoutError(f"timed out after {timeout}s on {host.name}: {' '.join(argv)}\n"
                           f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
