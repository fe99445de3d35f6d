"""Host names and addresses: whether one is loopback, a free port, this host as others see it.

Loopback is decided on the host part of an address (``tcp://HOST:PORT``, ``[::1]``, a bare
host), never by searching the whole string: ``127.0.0.1`` anywhere in a name is not loopback,
``127.0.0.2`` and ``::1`` are.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path


def host_of(address: str) -> str:
    """The host part of ``tcp://HOST:PORT``, ``HOST:PORT``, ``[V6]:PORT`` or a bare host."""
    rest = address.split("://", 1)[-1]
    if rest.startswith("["):  # an IPv6 literal: [::1]:5555
        return rest[1:].split("]", 1)[0]
    if rest.count(":") > 1:  # a bare IPv6 address
        return rest
    return rest.split(":", 1)[0]


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an address or a host) names this machine's loopback interface."""
    host = host_of(address).strip().lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (another process may still take it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def routable_host() -> str:
    """This machine's name as other hosts would reach it (falls back to loopback)."""
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
        return name
    except OSError:
        return "127.0.0.1"


def host_id() -> str:
    """Identifies this host (boot): two processes with equal ids can share memory."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
