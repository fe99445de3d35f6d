"""A run's own NVIDIA MPS daemon, for ``rollout.gpu_sharing=mps`` (local launcher).

Two processes on one GPU without MPS take turns on it: a time slice belongs to one context, so
a decode step's small kernels and a training step's large ones never run side by side. Under
MPS (Multi-Process Service) the clients' kernels share the GPU's SMs at once, and each client
can be held to a share of them (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``). Measured on one H100,
gsm8k (40 steps): the update ran at 161k tokens/s instead of 114k time-sliced, but the mean
step stayed 2.2-2.5 s, bound by what the GPU does in all (docs/results.md). Held to 30% (H200)
or 75% (H100) of the SMs, the hf engine decoded garbage (NaN log-probs), and a train rank held
to 70% had NaN gradients (the cause was not found), so an engine's share is 50 or 100
(`arl.config`), and the ranks are never held.

`MpsDaemon` starts ``nvidia-cuda-mps-control -f`` (in the foreground, so it is an owned child
like every other process arl starts, `arl.process`) with a private pipe directory: only the
processes given `MpsDaemon.client_env` become its clients, and other users and runs of the GPU
are left as they are. `MpsDaemon.stop` sends it ``quit`` (it ends the MPS server it started)
and ends what is left. `mps_node_env` is what one node of the plan gets.

``rollout.gpu_sharing=auto`` asks for MPS only where it can run: `wanted` says whether a run's
engines get a daemon, and `start_daemon` falls back to time-slicing (concurrent), saying why,
where the daemon does not start. Measured on three H100s (gsm8k, 40 steps, session 37), MPS
took 4% less time per trained token than time-slicing on every machine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from arl.config import ConfigError
from arl.process import OwnedProcess, spawn

log = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
SHARE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
_START_TIMEOUT_S = 15.0


def control_binary() -> str:
    """Path of ``nvidia-cuda-mps-control``, or a `ConfigError` saying what to do."""
    found = shutil.which(CONTROL)
    if found is None:
        raise ConfigError(
            f"rollout.gpu_sharing=mps needs NVIDIA's MPS control daemon ({CONTROL}, part of "
            "the NVIDIA driver's utilities) on PATH, and it is not found; add its folder to "
            "PATH, or use rollout.gpu_sharing=concurrent or alternate"
        )
    return found


def wanted(mode: str, shares_gpu: bool) -> bool:
    """Whether a local run in ``rollout.gpu_sharing`` mode ``mode`` starts an MPS daemon, where
    an engine shares a train rank's GPU (``shares_gpu``): always for mps (a missing daemon is a
    `ConfigError`), for auto where the daemon is on PATH."""
    if not shares_gpu or mode not in ("mps", "auto"):
        return False
    if mode == "mps":
        control_binary()
        return True
    return shutil.which(CONTROL) is not None


async def start_daemon(log_dir: Path, mode: str) -> MpsDaemon | None:
    """A started daemon; under auto, None (with a warning) where it does not start."""
    daemon = MpsDaemon(log_dir)
    try:
        await daemon.start()
    except RuntimeError as e:
        if mode == "mps":
            raise
        log.warning(
            "rollout.gpu_sharing=auto: MPS did not start, so the engines time-slice "
            "the GPU (as concurrent): %s",
            e,
        )
        return None
    return daemon


def mps_node_env(
    role: str, gpu_ids: tuple[int, ...], shares_gpu: bool, client_env: dict[str, str], percent: int
) -> dict[str, str]:
    """The MPS variables of one node: every node on a GPU is a client of the run's daemon; an
    inference engine that shares a GPU with a train rank is held to ``percent`` of its SMs
    (the train ranks may use all of them)."""
    if not gpu_ids:
        return {}
    env = dict(client_env)
    if role == "rollout" and shares_gpu:
        env[SHARE_ENV] = str(percent)
    return env


class MpsDaemon:
    """One private MPS control daemon: `start`, then `client_env` for the nodes, then `stop`.

    The pipe directory (its control socket) is a short temporary folder, since a Unix socket's
    path is limited to about 100 bytes; the logs go to ``log_dir`` (the run folder's ``mps``).
    """

    def __init__(self, log_dir: Path) -> None:
        self.binary = control_binary()
        self.log_dir = Path(log_dir)
        self.pipe_dir: Path | None = None
        self.proc: OwnedProcess | None = None

    @property
    def client_env(self) -> dict[str, str]:
        if self.pipe_dir is None:
            raise RuntimeError("the MPS daemon is not started")
        return {PIPE_ENV: str(self.pipe_dir), LOG_ENV: str(self.log_dir)}

    def _env(self) -> dict[str, str]:
        # Clients name GPUs relative to the daemon's own view: it sees them all, so a node's
        # CUDA_VISIBLE_DEVICES means what it means without MPS.
        drop = (SHARE_ENV, "CUDA_VISIBLE_DEVICES")
        return {k: v for k, v in os.environ.items() if k not in drop} | self.client_env

    async def start(self) -> None:
        """Start the daemon and wait for its control socket; a daemon that ends or does not
        open it in time is an error that quotes its log."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.pipe_dir = Path(tempfile.mkdtemp(prefix="arl-mps-"))
        out = open(self.log_dir / "daemon.out", "ab")  # noqa: SIM115 (the child holds it)
        try:
            self.proc = spawn([self.binary, "-f"], env=self._env(), stdout=out, stderr=out)
        except BaseException:
            await self.stop()  # the pipe folder
            raise
        finally:
            out.close()
        deadline = time.monotonic() + _START_TIMEOUT_S
        control = self.pipe_dir / "control"
        while not control.exists():
            if self.proc.returncode is not None or time.monotonic() > deadline:
                why = (
                    f"exited with status {self.proc.returncode}"
                    if self.proc.returncode is not None
                    else f"opened no control socket in {_START_TIMEOUT_S:.0f} s"
                )
                tail = self._log_tail()
                await self.stop()
                raise RuntimeError(
                    f"the MPS daemon ({self.binary} -f) {why}; its log ({self.log_dir}):\n{tail}"
                    "\nAnother MPS daemon or an exclusive-process compute mode on these GPUs "
                    "can cause this; use rollout.gpu_sharing=concurrent meanwhile"
                )
            await asyncio.sleep(0.05)
        log.info(
            "MPS daemon %d started (pipe %s, log %s)", self.proc.pid, self.pipe_dir, self.log_dir
        )

    async def stop(self, grace_s: float = 10.0) -> None:
        """Ask the daemon to quit (it ends its server), then end whatever is left; idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.returncode is None:
            try:
                await asyncio.to_thread(
                    subprocess.run,
                    [self.binary],
                    input=b"quit\n",
                    env=self._env(),
                    capture_output=True,
                    timeout=grace_s,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired) as e:
                log.warning("MPS daemon: quit failed (%s); ending it", e)
            deadline = time.monotonic() + grace_s
            while proc.returncode is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        if proc is not None:
            await proc.stop(grace_s=2.0)
        if self.pipe_dir is not None:
            shutil.rmtree(self.pipe_dir, ignore_errors=True)
            self.pipe_dir = None

    def _log_tail(self, n: int = 20) -> str:
        lines: list[str] = []
        for name in ("daemon.out", "control.log"):
            p = self.log_dir / name
            if p.exists():
                lines += [f"{name}: {x}" for x in p.read_text(errors="replace").splitlines()[-n:]]
        return "\n".join(lines) or "(empty)"
