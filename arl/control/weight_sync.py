"""Weight sync: new policy weights from the train ranks to every rollout engine (DESIGN §6).

Every mode does the same dance, around a mode-specific transfer::

    stage (train ranks, while rollout still generates) -> pause rollout -> transfer + load
    -> version + 1 -> resume (interrupted generations continue under the new version) -> clean up

- `ZmqWeightSync`: train rank 0 puts the full weights into its shard store as buckets; each
  rollout node pulls them over the data plane (shared memory on the same host, zero-copy
  frames otherwise) and copies them into its engine.
- `DiskWeightSync`: rank 0 writes an HF safetensors folder ``weights/v<N>``; engines reload it;
  the folder is removed after.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Protocol

from arl.control.cluster import Cluster
from arl.control.controller import RemoteObject
from arl.control.rollout import RolloutController
from arl.control.rtensor import RTensor, ShardRef


class WeightSync(Protocol):
    """Moves the trainer's weights into the rollout engines and bumps the version."""

    async def sync(self, version: int) -> dict:
        """Transfer weights, set ``version`` on the engines, resume; returns timing stats."""
        ...


class ZmqWeightSync:
    """Bucketed state dict from train rank 0 through the data plane."""

    def __init__(
        self,
        cluster: Cluster,
        train: list[RemoteObject],
        rollout_workers: list[RemoteObject],
        rollout: RolloutController,
        bucket_bytes: int,
        free: callable,
    ):
        self.cluster, self.train, self.workers = cluster, train, rollout_workers
        self.rollout, self.bucket_bytes, self.free = rollout, bucket_bytes, free

    async def sync(self, version: int) -> dict:
        """Stage on rank 0, pause, pull into every engine, resume at ``version``."""
        t0 = time.monotonic()
        prefix = f"weights/v{version}"
        metas = await asyncio.gather(
            *(w.publish_weights(prefix, self.bucket_bytes) for w in self.train)
        )
        owner = self.cluster.train[0].handle
        refs = [ShardRef.from_meta(owner.node_id, m) for m in metas[0]]
        buckets = RTensor(refs, peers={owner.node_id: owner.info["data_addr"]})
        t1 = time.monotonic()
        await self.rollout.pause()
        try:
            await asyncio.gather(*(w.load_weights(buckets.to_wire()) for w in self.workers))
        finally:
            await self.rollout.resume(version)
        t2 = time.monotonic()
        await self.free(list(buckets.refs))
        return {
            "sync/stage_s": t1 - t0,
            "sync/paused_s": t2 - t1,
            "sync/bytes": buckets.nbytes,
        }


class DiskWeightSync:
    """An HF safetensors folder per version, reloaded by each engine and removed after."""

    def __init__(
        self,
        train: list[RemoteObject],
        rollout_workers: list[RemoteObject],
        rollout: RolloutController,
        directory: Path,
    ):
        self.train, self.workers, self.rollout = train, rollout_workers, rollout
        self.directory = directory

    async def sync(self, version: int) -> dict:
        """Save on the train ranks, pause, reload in every engine, resume at ``version``."""
        t0 = time.monotonic()
        path = self.directory / f"v{version}"
        await asyncio.gather(*(w.save_hf(str(path)) for w in self.train))
        t1 = time.monotonic()
        await self.rollout.pause()
        try:
            await asyncio.gather(*(w.update_weights_from_disk(str(path)) for w in self.workers))
        finally:
            await self.rollout.resume(version)
        t2 = time.monotonic()
        shutil.rmtree(path, ignore_errors=True)
        return {"sync/stage_s": t1 - t0, "sync/paused_s": t2 - t1}
