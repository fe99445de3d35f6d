"""Start a controller and real `arl-node` subprocesses on 127.0.0.1 for a test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from arl.control.controller import Controller, NodeHandle
from arl.control.launcher import LocalNodes
from arl.wire.sockets import Security, new_secret


@asynccontextmanager
async def local_cluster(
    n: int,
    *,
    allow: tuple[str, ...] = ("arl.", "tests."),
    heartbeat_interval: float = 0.3,
    heartbeat_timeout: float = 15.0,
    curve: bool = False,
    env: dict[str, str] | None = None,
) -> AsyncIterator[tuple[Controller, list[NodeHandle], LocalNodes]]:
    """Yield (controller, nodes, processes); everything is ended on exit.

    The default timeout is far above a loaded machine's stalls (a node's loop waits seconds for
    the GIL while its role's modules import); a test about losing a node passes its own.
    """
    security = Security(new_secret(), curve=curve)
    node_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    async with Controller(
        security, heartbeat_interval=heartbeat_interval, heartbeat_timeout=heartbeat_timeout
    ) as ctl:
        async with LocalNodes(
            ctl.address,
            security,
            [node_env] * n,
            allowed_prefixes=allow,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
        ) as procs:
            nodes = await ctl.wait_for_nodes(n, timeout=90)
            yield ctl, nodes, procs
