"""Which address and interface this host uses to reach the other hosts of a job.

gloo (torch's CPU collectives) listens on the address its host name resolves to.
Where that is loopback, as in Debian's default ``127.0.1.1 <hostname>`` line of
``/etc/hosts``, ranks on other hosts cannot connect, and the job hangs until its
timeout. :func:`gloo_interface_for` then picks the interface that carries the
route to the rendezvous address, which is what ``GLOO_SOCKET_IFNAME`` would name.
These functions only read the host's configuration; ``trainbridge doctor --hosts``
reports with them too.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Dict, List, Optional


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def resolve(name: str) -> List[str]:
    """The IPv4 and IPv6 addresses ``name`` resolves to here (empty if it does not)."""
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return []
    return sorted({str(info[4][0]) for info in infos})


def resolves_only_to_loopback(name: str) -> bool:
    addresses = resolve(name)
    return bool(addresses) and all(is_loopback(a) for a in addresses)


def interface_addresses(up_only: bool = True) -> Dict[str, List[str]]:
    """IPv4 addresses of each interface of this host (``{"eth0": ["10.0.0.5"]}``), loopback included."""
    import psutil  # here: launcher detection imports this package and stays light

    stats = psutil.net_if_stats()
    out: Dict[str, List[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        if up_only and not (name in stats and stats[name].isup):
            continue
        v4 = [a.address for a in addrs if a.family == socket.AF_INET]
        if v4:
            out[name] = v4
    return out


def interface_of(address: str) -> Optional[str]:
    """The interface of this host that holds ``address``, or None."""
    for name, addrs in interface_addresses(up_only=False).items():
        if address in addrs:
            return name
    return None


def source_address_towards(address: str, port: int = 9) -> Optional[str]:
    """The local address the kernel would send from to reach ``address`` (no packet is sent), or None
    when there is no route."""
    targets = [a for a in resolve(address) if ":" not in a] or resolve(address)
    for target in targets:
        family = socket.AF_INET6 if ":" in target else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            try:
                sock.connect((target, port))  # UDP connect only picks a route
                return sock.getsockname()[0]
            except OSError:
                continue
    return None


def gloo_interface_for(peer: str) -> Optional[str]:
    """The non-loopback interface this host uses to reach ``peer`` (the rendezvous address), or None."""
    source = source_address_towards(peer)
    if source is None or is_loopback(source):
        return None
    return interface_of(source)


def first_external_address() -> Optional[str]:
    """An IPv4 address of the first interface that is up and not loopback, or None."""
    for _, addrs in sorted(interface_addresses().items()):
        for address in addrs:
            if not is_loopback(address):
                return address
    return None


def reachable_address(interface: Optional[str] = None) -> str:
    """An address of this host that other hosts can reach, for rank 0 to publish.

    An address, not a name: other hosts need not resolve names the way this one
    does (``getfqdn()`` can be ``localhost``). ``interface``'s (GLOO_SOCKET_IFNAME,
    HOROVOD_GLOO_IFACE) first; then the host name's non-loopback address; then the
    first external interface's; the fully qualified name as a last resort.
    """
    if interface:
        for address in interface_addresses(up_only=False).get(interface, []):
            return address
    external = [a for a in resolve(socket.gethostname()) if ":" not in a and not is_loopback(a)]
    return (external or [first_external_address() or socket.getfqdn()])[0]
