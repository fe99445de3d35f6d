"""Misbehaving user code and peers for the issue-19 tests, created on real `arl-node`s."""

from __future__ import annotations

import asyncio
import time
from typing import Any


async def blocking_reward(completion: str, data: dict[str, Any]) -> float:
    """A reward that blocks its node's event loop: a synchronous sleep inside ``async def``."""
    time.sleep(float(data.get("block_s", 30)))
    return 0.0


async def endless_reward(completion: str, data: dict[str, Any]) -> float:
    """A reward that never returns (but leaves the event loop free)."""
    await asyncio.sleep(3600)
    return 0.0


class WrongShapeWorker:
    """A rollout worker whose ``run_group`` answers with a result of the wrong shape."""

    def __init__(self, answer: Any = None):
        self.answer = answer

    async def run_group(self, key: str, data: dict) -> Any:
        """The configured wrong answer (e.g. None, or a map without 'meta')."""
        return self.answer

    async def pause(self, in_place: bool = False) -> None:
        """Nothing to pause."""

    async def resume(self) -> None:
        """Nothing to resume."""

    async def set_version(self, version: int) -> None:
        """Nothing to stamp."""
