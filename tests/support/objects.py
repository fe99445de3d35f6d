"""Small objects the integration tests create on real `arl-node` processes."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import torch


class Echo:
    """Returns what it is given; counts calls; can raise, sleep or block on request."""

    def __init__(self, tag: str = ""):
        self.tag = tag
        self.calls = 0

    def echo(self, value: Any) -> Any:
        """Blocking method: runs on the node's engine thread."""
        self.calls += 1
        return value

    async def aecho(self, value: Any, delay: float = 0.0) -> Any:
        """Async method: runs on the node's event loop; many can be in flight."""
        self.calls += 1
        if delay:
            await asyncio.sleep(delay)
        return value

    def fail(self, message: str) -> None:
        """Raise a ValueError carrying ``message``."""
        raise ValueError(message)

    def block(self, seconds: float) -> float:
        """Hold the engine thread for ``seconds``."""
        time.sleep(seconds)
        return seconds

    def checksum(self, t: torch.Tensor) -> float:
        """Sum of a tensor, computed on the node."""
        return float(t.double().sum())

    def pid(self) -> int:
        """The node's process id."""
        return os.getpid()

    def touch(self, path: str) -> str:
        """Write a file, so a test can see that this method ran."""
        with open(path, "w") as f:
            f.write("ran")
        return path
