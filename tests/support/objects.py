"""Small objects the integration tests create on real `arl-node` processes."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import torch

from arl.protocol.hosting import NodeContext, UsesNode


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


def make_group(seed: int, group_size: int, max_len: int) -> dict[str, torch.Tensor]:
    """A deterministic prompt group (trajectory layout) of random lengths for ``seed``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (group_size,), generator=g)
    L = int(lengths.max())
    att = torch.arange(L)[None, :] < lengths[:, None]
    return {
        "input_ids": torch.randint(0, 50_000, (group_size, L), generator=g) * att,
        "attention_mask": att,
        "loss_mask": att & (torch.arange(L)[None, :] >= 1),
        "logprobs": -torch.rand(group_size, L, generator=g) * att,
        "versions": torch.where(att, 0, -1).to(torch.int32),
        "rewards": torch.rand(group_size, generator=g),
    }


class ShardLab(UsesNode):
    """Produces shards into its node's store and consumes pulled ones, for RTensor tests."""

    def __init__(self, node: NodeContext):
        self.node = node

    def produce(self, key: str, seed: int, group_size: int, max_len: int) -> dict:
        """Store the group of ``seed`` under ``key``; returns its metadata."""
        return self.node.store.put(key, make_group(seed, group_size, max_len)).to_wire()

    def digest(self, shards: list[dict]) -> list[float]:
        """A checksum per pulled shard (the node pulled them for this call)."""
        return [float(sum(t.double().sum() for t in s.values())) for s in shards]

    def fetch(self, shards: list[dict]) -> list[dict]:
        """The pulled shards themselves (sent back to the caller)."""
        return shards

    def stats(self) -> dict:
        """The store's gauges and this process's resident memory."""
        with open("/proc/self/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
        return {**self.node.store.stats(), "rss_kb": rss}


class SlowWorkflow:
    """The RLVR workflow, except that a row with ``"slow": seconds`` first sleeps that long: an
    episode stuck on a slow tool or server, for the rollout.group_timeout tests."""

    def __init__(self, *args: Any, **kwargs: Any):
        from arl.workflows.rlvr import RLVRWorkflow

        self.inner = RLVRWorkflow(*args, **kwargs)

    async def arun_episode(self, engine: Any, data: dict, *args: Any) -> Any:
        """Sleep ``data["slow"]`` seconds (if set), then run the RLVR episode."""
        if data.get("slow"):
            await asyncio.sleep(float(data["slow"]))
        return await self.inner.arun_episode(engine, data, *args)


class Beside(UsesNode):
    """Built with an object its node already hosts (``host``) and with the node itself."""

    def __init__(self, host: Echo, node: NodeContext):
        self.host, self.node = host, node

    def host_tag(self) -> str:
        """The tag of the hosted object it was handed."""
        return self.host.tag

    def node_id(self) -> str:
        """The id of the node that built it."""
        return self.node.node_id
