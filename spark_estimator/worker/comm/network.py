"""Executor: the network interface gloo uses when a job's ranks span several hosts.

Gloo finds its own address by resolving the machine's host name; where that resolves to a
loopback address (an ``/etc/hosts`` that maps the name to 127.0.x.1) no rank on another
host can reach it. So when the ranks span several hosts and the user set no
``GLOO_SOCKET_IFNAME``, the task sets it, for the length of the group, to the interface
that carries its own address in the barrier context (``gloo_interface``).
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
import subprocess
from collections.abc import Sequence

log = logging.getLogger(__name__)


def gloo_interface(hosts: Sequence[str], rank: int) -> dict[str, str]:
    """``{"GLOO_SOCKET_IFNAME": name}`` for a group whose ranks span several hosts: the
    interface that carries ``hosts[rank]`` (this task's address in the barrier context);
    empty when the user chose one, the ranks share one host, the address is a loopback
    one, or no interface here carries it."""
    if "GLOO_SOCKET_IFNAME" in os.environ or len(set(hosts)) < 2:
        return {}
    try:
        address = ipaddress.ip_address(socket.gethostbyname(hosts[rank]))
    except (OSError, ValueError):
        return {}
    name = None if address.is_loopback else interface_of(str(address))
    log.debug("rank %d: gloo interface for %s: %s", rank, address, name)
    return {"GLOO_SOCKET_IFNAME": name} if name else {}


_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's (first) IPv4 address


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that carries the IPv4 ``address``, or
    None: each interface's address by ioctl, then ``ip -o addr`` for secondary ones."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    try:
        lines = subprocess.run(
            ["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=10
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    for line in lines:  # "2: eth0    inet 10.0.0.2/24 brd ... scope global eth0"
        fields = line.split()
        if len(fields) > 3 and fields[3].split("/")[0] == address:
            return fields[1]
    return None
