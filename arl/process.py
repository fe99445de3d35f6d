"""Child processes arl owns: started so that they end with their owner, ended as a whole group.

`spawn` starts a command in a session (and so a process group) of its own, so that ending it
reaches every process it started in turn. On Linux the child also asks the kernel for SIGTERM
when its parent goes away without ending it (SIGKILL, a crash): ``PR_SET_PDEATHSIG``. Two
details make that safe:

- No Python code runs between fork and exec (no ``preexec_fn``): in a forked child of a threaded
  program it can deadlock on a lock another thread held at the fork (seen: a pytest process
  with torch and loop threads left a child stuck before exec). Instead the child execs a tiny
  interpreter (`death_signal_argv`) that sets the signal, checks that the parent is still the
  one that spawned it, and execs the command; the signal setting survives that exec.
- The kernel sends the signal when the *thread* that forked the child ends, not the process.
  So spawn from a thread that lives as long as the owner (the event loop's thread, or a thread
  that waits on the child).

`OwnedProcess.stop` (async) and `stop_sync` end the group: SIGTERM, then SIGKILL to whatever
is left after a grace period, and reap the leader. Both are safe to call more than once.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

_POLL_S = 0.05
_PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h): the signal a child gets when its parent dies


# Run as ``python -I -c _SET_DEATH_SIGNAL PARENT_PID CMD ARGS...``: sets SIGTERM as the
# parent-death signal, exits if the parent already died, then becomes CMD (same pid).
_SET_DEATH_SIGNAL = (
    "import ctypes, os, signal, sys\n"
    f"ctypes.CDLL(None, use_errno=True).prctl({_PR_SET_PDEATHSIG}, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def death_signal_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` run so that it gets SIGTERM when this process (its spawning thread) dies; on
    systems without prctl, ``argv`` as it is (the owner's heartbeat timeout still ends an
    orphan)."""
    if not sys.platform.startswith("linux"):
        return [str(a) for a in argv]
    return [sys.executable, "-I", "-c", _SET_DEATH_SIGNAL, str(os.getpid()), *map(str, argv)]


def process_group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids whose process group is ``pgid``; Linux, via /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # the process ended while we looked
            continue
        # Fields after the parenthesised command name: state ppid pgrp ...
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


class OwnedProcess:
    """One spawned command and its process group; `stop` ends them all."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen

    @property
    def pid(self) -> int:
        """The leader's pid (also the group's id)."""
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        """The leader's exit status, or None while it runs."""
        return self.popen.poll()

    async def wait(self) -> int:
        """Wait (without blocking the event loop) until the leader exits; its exit status."""
        while (code := self.popen.poll()) is None:
            await asyncio.sleep(_POLL_S)
        return code

    def group_alive(self) -> bool:
        """Whether any process of the group is still running (the leader is reaped first)."""
        self.popen.poll()
        if sys.platform.startswith("linux"):
            return bool(process_group_members(self.pid))
        return self.popen.returncode is None

    def signal_group(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the whole group; a group that is gone is left alone."""
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            pass  # the pgid was reused by a process we do not own: ours is gone

    async def stop(self, grace_s: float) -> bool:
        """End the group: SIGTERM, SIGKILL after ``grace_s``. True if SIGKILL was needed."""
        if not self.group_alive():
            return False
        self.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.group_alive() and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        return self._kill_rest()

    def stop_sync(self, grace_s: float) -> bool:
        """Blocking `stop`, for interpreter exit and threads without an event loop."""
        if not self.group_alive():
            return False
        self.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.group_alive() and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        return self._kill_rest()

    def _kill_rest(self) -> bool:
        killed = self.group_alive()
        if killed:
            self.signal_group(signal.SIGKILL)
        self.popen.wait()
        return killed


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    stdout: IO[Any] | int | None = None,
    stderr: IO[Any] | int | None = None,
) -> OwnedProcess:
    """Start ``argv`` in a new session with the parent-death signal set (see the module doc).

    ``env`` replaces the environment when given (callers merge ``os.environ`` themselves);
    stdin is /dev/null. Raises `OSError` when the command cannot be run.
    """
    argv = [str(a) for a in argv]
    env = None if env is None else dict(env)
    # The exec happens in the wrapper, so a missing command is looked up here, where the
    # caller gets the OSError it would get from Popen.
    search = (env or os.environ).get("PATH", os.defpath)
    if not argv or shutil.which(argv[0], path=search if os.sep not in argv[0] else None) is None:
        raise FileNotFoundError(f"cannot run {argv[0] if argv else '(empty command)'!r}")
    popen = subprocess.Popen(
        death_signal_argv(argv),
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
    )
    return OwnedProcess(popen)
