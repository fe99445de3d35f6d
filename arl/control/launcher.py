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
A started process's stderr passes on to the launcher's own (`StderrTail`), which keeps its last
lines: ``exited()`` names a process that ended while the run waited for its nodes, with them.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO, Any

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
    cmd = [python, "-m", "arl.node", "--controller", controller]
    if node_id:
        cmd += ["--node-id", node_id]
    for p in allowed_prefixes:
        cmd += ["--allow-import", p]
    if curve:
        cmd.append("--curve")
    cmd += ["--heartbeat-interval", str(heartbeat_interval)]
    cmd += ["--heartbeat-timeout", str(heartbeat_timeout)]
    if max_message_bytes > 0:
        cmd += ["--max-message-bytes", str(max_message_bytes)]
    return cmd


class StderrTail:
    """Copies a child's stderr pipe to this process's stderr line by line as it arrives and
    keeps its last lines, for the error that reports the child's exit. A thread, not the event
    loop, reads the pipe: a busy loop must never make a child block on a full pipe.

    Only whole lines are copied, and a child that ends mid-line (a progress bar redrawn with
    ``\r``, cut off when the node is ended) gets its last line ended: otherwise this process's
    next line, such as the run's ``error:`` line, would continue the child's."""

    def __init__(self, pipe: IO[bytes], name: str, keep_bytes: int = 16384):
        self._pipe, self._keep = pipe, keep_bytes
        self._tail = ""
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._pump, name=f"arl-stderr-{name}", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        partial = ""  # the child's current line, not yet ended
        try:
            while chunk := self._pipe.read1(65536):  # type: ignore[attr-defined]
                text = decoder.decode(chunk)
                with self._lock:
                    self._tail = (self._tail + text)[-self._keep :]
                whole, newline, partial = (partial + text).rpartition("\n")
                if newline:
                    self._write(whole + newline)
                if len(partial) > self._keep:  # a line without end: pass it on as it is
                    self._write(partial)
                    partial = ""
        finally:
            self._pipe.close()
            if partial:
                self._write(partial + "\n")

    @staticmethod
    def _write(text: str) -> None:
        try:
            sys.stderr.write(text)
            sys.stderr.flush()
        except (OSError, ValueError):
            pass  # our stderr is gone: keep draining, so the child never blocks

    def last_lines(self, n: int = 10, wait_s: float = 1.0) -> list[str]:
        """The last ``n`` lines; waits up to ``wait_s`` for the rest of an ended child's output."""
        self._thread.join(wait_s)
        with self._lock:
            return self._tail.splitlines()[-n:]

    def close(self, wait_s: float = 5.0) -> None:
        """Wait for the pipe's end (the child and everything holding the pipe are gone)."""
        self._thread.join(wait_s)


def exit_report(what: str, code: int, tail: StderrTail) -> str:
    """``what`` ended with status ``code``, and its last stderr lines."""
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    lines = tail.last_lines()
    shown = "".join(f"\n  | {line}" for line in lines) if lines else " (it wrote nothing)"
    return f"{what} {how}; the last lines of its stderr:{shown}"


def _spawn_watched(
    cmd: list[str], env: dict[str, str], name: str
) -> tuple[OwnedProcess, StderrTail]:
    proc = spawn(cmd, env=env, stderr=subprocess.PIPE)
    return proc, StderrTail(proc.popen.stderr, name)  # type: ignore[arg-type]


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
        self.tails: list[StderrTail] = []

    async def __aenter__(self) -> LocalNodes:
        try:
            for node_id, extra_env in zip(self.node_ids, self.node_envs, strict=True):
                env = {**os.environ, **extra_env, SECRET_ENV: self.security.secret}
                cmd = node_command(
                    self.controller, node_id=node_id, curve=self.security.curve, **self.command_kw
                )
                proc, tail = _spawn_watched(cmd, env, node_id)
                self.procs.append(proc)
                self.tails.append(tail)
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

    def exited(self) -> str | None:
        """The first node process that has ended, with its exit status and last stderr lines;
        None while all of them run."""
        for node_id, proc, tail in zip(self.node_ids, self.procs, self.tails, strict=False):
            code = proc.returncode
            if code is not None:
                return exit_report(f"node process {node_id} (pid {proc.pid})", code, tail)
        return None

    async def close(self) -> None:
        """End every node: SIGTERM to its process group, SIGKILL after the grace period."""
        await asyncio.gather(*(p.stop(self.grace) for p in self.procs))
        await asyncio.gather(*(asyncio.to_thread(t.close) for t in self.tails))


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
        self.tail: StderrTail | None = None

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
        self.proc, self.tail = _spawn_watched(cmd, env, "srun")
        return self

    def exited(self) -> str | None:
        """The srun step, with its exit status and last stderr lines, once it has ended (srun
        exits at once when Slurm refuses the allocation); None while it runs."""
        if self.proc is None or self.tail is None or self.proc.returncode is None:
            return None
        return exit_report(f"srun (pid {self.proc.pid})", self.proc.returncode, self.tail)

    async def __aexit__(self, *exc: Any) -> None:
        if self.proc is not None:
            await self.proc.stop(self.grace)
        if self.tail is not None:
            await asyncio.to_thread(self.tail.close)
