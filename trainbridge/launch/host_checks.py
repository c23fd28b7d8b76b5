"""Checks for a job across hosts, run before it starts (``trainbridge doctor --hosts``).

Each check returns problems as single lines that name the values and the fix.
They catch what made multi-host runs hang in testing:

- a host name that resolves only to loopback (gloo listens there);
- hosts that reach each other on interfaces of different names (Horovod's Gloo
  controller uses the first host's name on every host);
- a torchrun c10d rendezvous endpoint that no host's agent will serve;
- a MASTER_ADDR that this host cannot reach.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from typing import Dict, List, Optional, Sequence

from .network import gloo_interface_for, is_loopback, resolve, resolves_only_to_loopback, source_address_towards


def is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def check_own_name(hosts: Sequence[str]) -> List[str]:
    """This host's name must resolve to an address the other hosts can reach."""
    name = socket.gethostname()
    addresses = resolve(name)
    towards = next((i for i in (gloo_interface_for(h) for h in hosts if h != name) if i), None)
    iface = f"GLOO_SOCKET_IFNAME={towards}" if towards else "GLOO_SOCKET_IFNAME=<the interface that links the hosts>"
    if not addresses:
        return [
            f"host name {name!r} does not resolve: gloo falls back to loopback and other hosts cannot connect; "
            f"add it with its network address to /etc/hosts, or set {iface}"
        ]
    if resolves_only_to_loopback(name):
        return [
            f"host name {name!r} resolves only to loopback ({', '.join(addresses)}): gloo listens there and other "
            f"hosts cannot connect; map it to its network address in /etc/hosts, or set {iface} "
            f"(trainbridge sets it itself; torchrun c10d also needs --local-addr <this host's address>)"
        ]
    return []


def check_host_names(hosts: Sequence[str]) -> List[str]:
    """Every listed host must resolve here, and not to loopback unless it is this host."""
    problems = []
    own = socket.gethostname()
    for host in hosts:
        addresses = resolve(host)
        if not addresses:
            problems.append(
                f"host {host!r} does not resolve on {own}: add it with its address to /etc/hosts (or DNS) on every host"
            )
        elif host != own and all(is_loopback(a) for a in addresses):
            problems.append(
                f"host {host!r} resolves to loopback ({', '.join(addresses)}) on {own}: fix its line in /etc/hosts"
            )
        elif source_address_towards(host) is None:
            problems.append(
                f"no route from {own} to host {host!r} ({', '.join(addresses)}): check the network, or "
                f"list the host by an address this host can reach"
            )
    return problems


def check_interfaces(interfaces: Dict[str, Optional[str]]) -> List[str]:
    """``interfaces``: host -> name of the interface that carries the job there (None: unknown)."""
    known = {host: iface for host, iface in interfaces.items() if iface}
    if len(set(known.values())) <= 1:
        return []
    listing = ", ".join(f"{host}: {iface}" for host, iface in known.items())
    return [
        f"the hosts reach each other on interfaces with different names ({listing}): Horovod's Gloo controller "
        f"uses the first host's name on every host; give the link one name on every host, or pass horovodrun "
        f"--network-interface with a name every host has (torch: GLOO_SOCKET_IFNAME per host)"
    ]


def endpoint_matches(endpoint_host: str, host: str) -> bool:
    """Whether torchrun's agent on ``host`` would take ``endpoint_host`` as itself and serve the store.

    torchrun compares the endpoint with its host name and with the addresses that
    name resolves to (``getaddrinfo(gethostname())``); host names are resolved here.
    """
    if endpoint_host == host:
        return True
    if host == socket.gethostname() and endpoint_host == "localhost":
        return True
    return is_ip(endpoint_host) and endpoint_host in resolve(host)


def check_rendezvous_endpoint(endpoint: str, hosts: Sequence[str]) -> List[str]:
    """A c10d endpoint ``HOST:PORT`` must be one of the hosts, as their agents see themselves."""
    host = endpoint.rsplit(":", 1)[0].strip("[]")
    if any(endpoint_matches(host, h) for h in hosts):
        return []
    seen = ", ".join(f"{h} -> {'/'.join(resolve(h)) or 'unresolved'}" for h in hosts)
    return [
        f"rendezvous endpoint {endpoint} is none of the hosts as they resolve ({seen}), so no torchrun agent "
        f"will serve it and every agent waits; use the first host's name, or pass --local-addr "
        f"<its address> on every host and --rdzv-conf is_host=1 on the one at {host}"
    ]


def check_master_addr(addr: str, port: Optional[int], hosts: Sequence[str], wait: float = 3.0) -> List[str]:
    """MASTER_ADDR must resolve, not be loopback for a job of several hosts, and answer from here."""
    if not resolve(addr):
        return [
            f"MASTER_ADDR {addr} does not resolve on {socket.gethostname()}: use the first host's address or "
            f"a name every host resolves"
        ]
    if len(hosts) > 1 and resolves_only_to_loopback(addr):
        return [
            f"MASTER_ADDR {addr} is loopback, which the other hosts cannot reach: use the first host's network address"
        ]
    if source_address_towards(addr) is None:
        return [
            f"MASTER_ADDR {addr} is not reachable from {socket.gethostname()} (no route): use an address of the "
            f"first host that every host can reach"
        ]
    if port is None:
        return []
    try:
        with socket.create_connection((addr, port), timeout=wait):
            return []  # something listens already: the rendezvous of a running job, or another program
    except ConnectionRefusedError:
        return []  # the host answered; nothing listens before the job starts
    except OSError as exc:
        if exc.errno == errno.ECONNREFUSED:
            return []
        why = "no answer" if isinstance(exc, socket.timeout) else (exc.strerror or str(exc))
        return [
            f"MASTER_ADDR {addr} is not reachable from {socket.gethostname()} ({why} within {wait:.0f}s on "
            f"port {port}): use an address of the first host that every host can reach, and open MASTER_PORT"
        ]
