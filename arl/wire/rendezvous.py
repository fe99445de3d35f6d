"""torch.distributed rendezvous stores that listen only on the run's address.

torch's `TCPStore` server (train rank 0's, behind ``init_method=tcp://HOST:PORT``) listens on
every interface whatever HOST is, and it has no authentication. `tcp_store` binds the listening
socket itself on HOST (loopback for a local run) and hands it to torch.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any
from urllib.parse import urlsplit


def split_tcp_url(url: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (HOST, PORT); ValueError naming the url otherwise."""
    parts = urlsplit(url)
    if parts.scheme != "tcp" or not parts.hostname or not parts.port:
        raise ValueError(f"rendezvous address {url!r} must look like tcp://HOST:PORT")
    return parts.hostname, parts.port


def tcp_store(
    host: str, port: int, world_size: int, is_master: bool, timeout: datetime.timedelta
) -> Any:
    """A `torch.distributed.TCPStore`; the master's server listens on ``host:port`` only."""
    import torch.distributed as dist

    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    # The store's server owns the descriptor from here on (and closes it with the store).
    return dist.TCPStore(
        host,
        port,
        world_size,
        True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )
