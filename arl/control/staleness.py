"""The staleness semaphore in front of rollout submission (DESIGN §5) and the per-sample check.

With ``B`` the batch size in prompt groups, ``v`` the current policy version and
``eta = max_staleness`` (max_head_offpolicyness)::

    capacity = min(max_concurrent - running, (eta + v + 1) * B - (accepted + running))

``accepted`` counts groups ever accepted (the trainer taking a batch does not decrease it), so
the groups started so far never exceed ``(eta + v + 1) * B``. If groups are taken in the order
they started (``rollout.batch_order=submitted``), a group started at version ``u`` lands in a
batch ``k <= u + eta``: it is at most ``eta`` versions old when trained. Taken as they finish
(the default), the rollout controller keeps the same bound by taking, first, the groups that
would otherwise miss it. `is_stale` checks every sample anyway, for the trainer's keep/drop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class StalenessError(RuntimeError):
    """The semaphore was used in a way its counters cannot represent."""


def is_stale(oldest_token_version: int, current_version: int, eta: int) -> bool:
    """True if a sample is more than ``eta`` versions behind: ``current - oldest > eta``.

    ``oldest_token_version`` is the smallest version over generated tokens (prompt tokens carry
    -1 and must be left out); ``current_version`` is the version of the policy being trained.
    """
    if oldest_token_version < 0:
        raise ValueError(
            f"oldest_token_version={oldest_token_version} is negative: take the minimum over "
            "generated tokens only (prompt tokens carry version -1)"
        )
    if oldest_token_version > current_version:
        raise ValueError(
            f"oldest_token_version={oldest_token_version} is newer than the current version "
            f"{current_version}: the versions come from different runs or clocks"
        )
    return current_version - oldest_token_version > eta


class StalenessSemaphore:
    """Grants rollout slots while ``capacity > 0`` (formula in the module docstring).

    Use from one event loop. ``version_source`` (a zero-argument callable) may be injected;
    then call `version_changed()` after it moves. Without one, `set_version` holds the version.
    """

    def __init__(
        self,
        batch_size: int,
        max_staleness: int,
        max_concurrent: int,
        version_source: Callable[[], int] | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be at least 1 prompt group")
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness}: must be >= 0 (0 = synchronous RL)")
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent={max_concurrent}: must be at least 1")
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.max_concurrent = max_concurrent
        self._own_version = 0
        self._version_source = version_source
        self._running = 0
        self._accepted = 0
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def version(self) -> int:
        """The current policy version, from the injected source or `set_version`."""
        if self._version_source is not None:
            return self._version_source()
        return self._own_version

    @property
    def running(self) -> int:
        """Rollouts granted a slot and not yet released."""
        return self._running

    @property
    def accepted(self) -> int:
        """Groups ever accepted (cumulative)."""
        return self._accepted

    def capacity(self) -> int:
        """How many more rollouts may start now (may be <= 0)."""
        budget = (self.max_staleness + self.version + 1) * self.batch_size
        return min(self.max_concurrent - self._running, budget - (self._accepted + self._running))

    async def acquire(self) -> None:
        """Wait until capacity is positive, then count one running rollout."""
        loop = asyncio.get_running_loop()
        while self.capacity() <= 0:
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.append(fut)
            try:
                await fut
            finally:
                self._waiters.remove(fut)
        self._running += 1

    def release(self, accepted: bool) -> None:
        """End one rollout: running - 1, and accepted + 1 if its group was accepted.

        A rejected (or failed, or cancelled) group frees its slot without counting.
        """
        if self._running <= 0:
            raise StalenessError("release() without a matching acquire(): no rollout is running")
        self._running -= 1
        if accepted:
            self._accepted += 1
        self._wake_all()

    def forget(self) -> None:
        """Take back one accepted group that will never be trained (dropped as too stale):
        its place in the budget goes to a replacement, so drops do not narrow eta for good."""
        if self._accepted <= 0:
            raise StalenessError("forget() with no accepted group to take back")
        self._accepted -= 1
        self._wake_all()

    def set_version(self, version: int) -> None:
        """Record a new policy version and wake waiters (versions never go back)."""
        if self._version_source is not None:
            raise StalenessError(
                "this semaphore reads its version from an injected source; update the source "
                "and call version_changed() instead of set_version()"
            )
        if version < self._own_version:
            raise StalenessError(
                f"version went back from {self._own_version} to {version}; versions only grow "
                "(after recovery use load_state_dict)"
            )
        self._own_version = version
        self._wake_all()

    def version_changed(self) -> None:
        """Wake waiters after an injected version source moved."""
        self._wake_all()

    def state_dict(self) -> dict[str, Any]:
        """Counters to save with a checkpoint (running is not saved: in-flight work is lost)."""
        return {
            "accepted": self._accepted,
            "version": self.version,
            "batch_size": self.batch_size,
            "max_staleness": self.max_staleness,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters after recovery; running restarts at 0.

        Restoring ``accepted`` keeps capacity at what the restored version allows instead of
        the ``(eta + v + 1) * B`` burst fresh counters would give. If groups accepted but never
        trained were lost in the crash, pass ``accepted`` reduced by their number.
        """
        if self._running:
            raise StalenessError(
                f"load_state_dict() with {self._running} rollouts running; restore before "
                "starting rollouts"
            )
        if state["batch_size"] != self.batch_size:
            raise StalenessError(
                f"checkpoint batch_size={state['batch_size']} != configured {self.batch_size}; "
                "the accepted count would mean a different number of batches"
            )
        self._accepted = int(state["accepted"])
        if self._version_source is None:
            self._own_version = int(state["version"])
        self._wake_all()

    def _wake_all(self) -> None:
        # Every waiter re-checks capacity itself, so waking all cannot lose a wake-up.
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
