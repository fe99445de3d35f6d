"""A stop is a checkpoint: the request to end a run after saving where it is.

SIGTERM (Slurm at a time limit or a preemption, ``timeout``, systemd) and a first Ctrl-C reach
the trainer as a `StopRequest`: the trainer finishes the step being trained (or abandons the
wait for a batch: nothing of it was trained), writes a recovery checkpoint marked as a stop's,
and raises `RunStopped`; rerunning the same command resumes from it. Within ``grace_s`` (the
setting ``recover.stop_grace_s``) or the run is ended without the checkpoint by
``on_expiry``; so is it by a second signal (the launcher's handler decides that).

The launcher's signal handler calls `request`; the trainer calls `arm` when its loop starts
(a stop before then has nothing to save and ends the run as before), waits for rollout through
`unless_stopped`, and ends with `stop_with_checkpoint`, which calls `done` once the checkpoint
is on disk.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn


class RunStopped(Exception):
    """The run stopped on request; ``path`` holds its checkpoint (None: nothing to save)."""

    def __init__(self, signum: int, step: int, path: Path | None, seconds: float, note: str):
        self.signum, self.step, self.path, self.seconds = signum, step, path, seconds
        super().__init__(note)

    @property
    def exit_status(self) -> int:
        """128 + the signal: 143 for SIGTERM, 130 for Ctrl-C (SIGINT)."""
        return 128 + self.signum


def signal_name(signum: int) -> str:
    """``SIGTERM`` or ``Ctrl-C`` (SIGINT), as a user reads it."""
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class StopRequest:
    """A stop asked for by a signal, seen by the trainer's loop (one per launch)."""

    def __init__(self, grace_s: float = 60.0, on_expiry: Callable[[], object] | None = None):
        if grace_s <= 0:
            raise ValueError(f"grace_s={grace_s}: the stop's grace period must be > 0 seconds")
        self.grace_s = grace_s
        self.on_expiry = on_expiry
        self.signum: int | None = None
        self.expired = False
        self.settled = False  # `done` was called: the stop's checkpoint is on disk (or needless)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._timer: asyncio.TimerHandle | None = None

    @property
    def requested(self) -> bool:
        """Whether a stop was asked for."""
        return self.signum is not None

    @property
    def armed(self) -> bool:
        """Whether a trainer loop runs that will checkpoint on a stop."""
        return self._loop is not None and not self._loop.is_closed()

    def arm(self) -> None:
        """Called by the trainer in its running loop: stops from now on are checkpointed."""
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()
        if self.requested:
            self._begin()

    def request(self, signum: int) -> bool:
        """Ask for a stop (from a signal handler in the loop's thread, or the loop itself);
        True when an armed trainer will checkpoint it, False when nothing would."""
        if self.signum is None:
            self.signum = signum
        if not self.armed:
            return False
        self._loop.call_soon_threadsafe(self._begin)
        return True

    def _begin(self) -> None:
        assert self._event is not None and self._loop is not None
        self._event.set()
        if self._timer is None:
            self._timer = self._loop.call_later(self.grace_s, self._expire)

    def _expire(self) -> None:
        self.expired = True
        if self.on_expiry is not None:
            self.on_expiry()

    async def wait(self) -> None:
        """Return once a stop was asked for (the trainer must have called `arm`)."""
        assert self._event is not None, "arm() first"
        await self._event.wait()

    def done(self) -> None:
        """The checkpoint is written (or nothing needed one): the grace period is over."""
        self.settled = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


async def unless_stopped(aw: Awaitable[Any], stop: StopRequest | None) -> Any:
    """``aw``'s result, or None when ``stop`` is asked for first (``aw`` is cancelled)."""
    task = asyncio.ensure_future(aw)
    if stop is None:
        return await task
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, stopped, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def stop_with_checkpoint(
    stop: StopRequest,
    step: int,
    written: Path | None,
    save: Callable[[], Awaitable[tuple[Path, float]]],
    grace_s: float,
) -> NoReturn:
    """End a run stopped after ``step``: write its recovery checkpoint with ``save`` (returns
    its folder and seconds) unless ``written`` already holds this step's, or nothing was
    trained; then raise `RunStopped` saying where and how long it took. ``grace_s`` is
    ``recover.stop_grace_s``, named to the user while the checkpoint is written."""
    how = signal_name(stop.signum)
    path, seconds = None, 0.0
    if step == 0:
        note = f"stopped by {how} before the first step finished: there was nothing to save"
    elif written is not None:
        path = written
        note = f"stopped by {how} after step {step}; its checkpoint is {path}"
    else:
        print(
            f"stopping ({how}): writing the recovery checkpoint of step {step} "
            f"(within recover.stop_grace_s={grace_s:g}s; a second "
            "signal ends the run without it)",
            flush=True,
        )
        path, seconds = await save()
        note = (
            f"stopped by {how} after step {step}: the recovery checkpoint was written "
            f"to {path} in {seconds:.1f} s"
        )
    stop.done()
    raise RunStopped(stop.signum, step, path, seconds, note)
