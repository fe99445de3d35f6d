"""How node processes start (DESIGN §8). Launch modes differ only here.

- `LocalNodes`: spawns ``arl-node`` subprocesses on this machine and ends them on exit, on
  Ctrl-C, on an exception, and (through PR_SET_PDEATHSIG plus the heartbeat timeout) when the
  launcher itself is killed.
- `SlurmNodes`: inside an allocation, one ``srun arl-node ...`` step starts every node.
- `arl.control.ray_launcher.RayNodes`: on an existing Ray cluster, one Ray actor per node (in
  a placement group holding the GPUs and CPUs of its role) starts and supervises its
  ``arl-node``; ``ray`` is imported there only, and only when that mode is used.
- attach mode starts nothing: nodes started elsewhere (a job script) connect by themselves.

Whatever starts them, the nodes are the same daemon and talk to the controller over arl's own
sockets. The run secret reaches spawned nodes through the environment, never the command line.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from typing import Any

from arl.process import OwnedProcess, spawn
from arl.wire.sockets import SECRET_ENV, Security

log = logging.getLogger("arl.launcher")


def node_command(
    controller: str,
    *,
    node_id: str = "",
    allowed_prefixes: Sequence[str] = ("arl.",),
    curve: bool = False,
    heartbeat_interval: float = 1.0,
    heartbeat_timeout: float = 10.0,
    max_message_bytes: int = -1,
    python: str = sys.executable,
) -> list[str]:
    """The command line that starts one node."""
    cmd = [python, "-m", "arl.node.daemon", "--controller", controller]
    if node_id:
        cmd += ["--node-id", node_id]
    for p in allowed_prefixes:
        cmd += ["--allow-import", p]
    if curve:
        cmd.append("--curve")
    cmd += ["--heartbeat-interval", str(heartbeat_interval)]
    cmd += ["--heartbeat-timeout", str(heartbeat_timeout)]
    if max_message_bytes > 0:  # wired through so LocalNodes/SlurmNodes can set the daemon's cap
        cmd += ["--max-message-bytes", str(max_message_bytes)]
    return cmd


class LocalNodes:
    """Spawn ``n`` node processes on this machine; an async context manager that ends them."""

    def __init__(
        self,
        controller: str,
        security: Security,
        node_envs: Sequence[dict[str, str]],
        *,
        node_ids: Sequence[str] | None = None,
        grace: float = 10.0,
        **command_kw: Any,
    ):
        self.controller, self.security = controller, security
        self.node_envs = list(node_envs)
        self.node_ids = list(node_ids or [f"node{i}" for i in range(len(self.node_envs))])
        self.grace = grace
        self.command_kw = command_kw
        self.procs: list[OwnedProcess] = []

    async def __aenter__(self) -> LocalNodes:
        try:
            for node_id, extra_env in zip(self.node_ids, self.node_envs, strict=True):
                env = {**os.environ, **extra_env, SECRET_ENV: self.security.secret}
                cmd = node_command(
                    self.controller, node_id=node_id, curve=self.security.curve, **self.command_kw
                )
                self.procs.append(spawn(cmd, env=env))
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    @property
    def pids(self) -> list[int]:
        """Process ids of the spawned nodes."""
        return [p.pid for p in self.procs]

    async def close(self) -> None:
        """End every node: SIGTERM to its process group, SIGKILL after the grace period."""
        await asyncio.gather(*(p.stop(self.grace) for p in self.procs))


class SlurmNodes:
    """Start the nodes as one ``srun`` step inside the current Slurm allocation."""

    def __init__(
        self,
        controller: str,
        security: Security,
        n_nodes: int,
        *,
        srun_args: Sequence[str] = (),
        grace: float = 10.0,
        **command_kw: Any,
    ):
        if shutil.which("srun") is None:
            raise RuntimeError(
                "cluster.launcher=slurm needs `srun` on PATH (run inside an "
                "allocation: salloc/sbatch), or use cluster.launcher=attach"
            )
        self.controller, self.security, self.n_nodes = controller, security, n_nodes
        self.srun_args, self.grace, self.command_kw = list(srun_args), grace, command_kw
        self.proc: OwnedProcess | None = None

    async def __aenter__(self) -> SlurmNodes:
        node_cmd = node_command(self.controller, curve=self.security.curve, **self.command_kw)
        cmd = [
            "srun",
            f"--ntasks={self.n_nodes}",
            "--kill-on-bad-exit=1",
            *self.srun_args,
            *node_cmd,
        ]
        env = {**os.environ, SECRET_ENV: self.security.secret}
        self.proc = spawn(cmd, env=env)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.proc is not None:
            await self.proc.stop(self.grace)
