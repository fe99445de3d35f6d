"""Child processes arl owns: started so that they end with their owner, ended as a whole group.

`spawn` starts a command in a session (and so a process group) of its own, so that ending it
reaches every process it started in turn. On Linux the child also asks the kernel for SIGTERM
when its parent goes away without ending it (SIGKILL, a crash): ``PR_SET_PDEATHSIG``. Two
details make that safe:

- ``prctl`` is looked up in the parent; between fork and exec the child only calls it. Loading
  a library in a forked child of a threaded program can deadlock on a lock another thread held.
- The kernel sends the signal when the *thread* that forked the child ends, not the process.
  So spawn from a thread that lives as long as the owner (the event loop's thread, or a thread
  that waits on the child).

`OwnedProcess.stop` (async) and `stop_sync` end the group: SIGTERM, then SIGKILL to whatever
is left after a grace period, and reap the leader. Both are safe to call more than once.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.05


def death_signal_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` that sets the parent-death signal (SIGTERM), or None where prctl does
    not exist (there the owner's heartbeat timeout still ends an orphan)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return hook


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
    popen = subprocess.Popen(
        [str(a) for a in argv],
        env=None if env is None else dict(env),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
        preexec_fn=death_signal_hook(),
    )
    return OwnedProcess(popen)
