"""Weight sync: new policy weights from the train ranks to every rollout engine (DESIGN §6).

Every mode does the same dance, around a mode-specific transfer::

    stage (train ranks, while rollout still generates) -> pause rollout -> transfer + load
    -> version + 1 -> resume (interrupted generations continue under the new version) -> clean up

- `ZmqWeightSync`: train rank 0 puts the full weights into its shard store as buckets; each
  rollout node pulls them over the data plane (shared memory on the same host, zero-copy
  frames otherwise) and copies them into its engine.
- `DiskWeightSync`: rank 0 writes an HF safetensors folder ``weights/v<N>``; engines reload it;
  the folder is removed after.
- `NcclWeightSync`: rank 0 broadcasts the weights bucket by bucket over a process group of its
  own with every engine (NCCL on GPUs; gloo on CPU, the stand-in that runs the same code).
- `IpcWeightSync`: engine and trainer on one GPU; rank 0 fills one CUDA bucket buffer at a time
  and hands its CUDA IPC handle (plain fields, no pickle) to the engines, which copy and ack.

Before the first sync every mode tells the train ranks the engines' dtype, so weights travel
(and the trainer's checksum is taken) in the dtype the engines hold: bf16 engines get bf16.
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


class WeightSyncError(RuntimeError):
    """The weight sync cannot run as configured (e.g. engines disagree on their dtype)."""


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
        self.ready = False

    async def sync(self, version: int) -> dict:
        """Stage on rank 0, pause, pull into every engine, resume at ``version``."""
        t0 = time.monotonic()
        if not self.ready:
            await match_engine_dtype(self.train, self.workers)
            self.ready = True
        prefix = f"weights/v{version}"
        metas = await asyncio.gather(
            *(w.publish_weights(prefix, self.bucket_bytes) for w in self.train)
        )
        owner = self.cluster.train[0].handle
        refs = [ShardRef.from_meta(owner.node_id, m) for m in metas[0]]
        buckets = RTensor(refs, peers={owner.node_id: owner.info["data_addr"]})
        t1 = time.monotonic()
        async with self.rollout.paused(version):
            await asyncio.gather(*(w.load_weights(buckets.to_wire()) for w in self.workers))
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
        self.ready = False

    async def sync(self, version: int) -> dict:
        """Save on the train ranks, pause, reload in every engine, resume at ``version``."""
        t0 = time.monotonic()
        if not self.ready:
            await match_engine_dtype(self.train, self.workers)
            self.ready = True
        path = self.directory / f"v{version}"
        await asyncio.gather(*(w.save_hf(str(path)) for w in self.train))
        t1 = time.monotonic()
        async with self.rollout.paused(version):
            await asyncio.gather(*(w.update_weights_from_disk(str(path)) for w in self.workers))
        t2 = time.monotonic()
        shutil.rmtree(path, ignore_errors=True)
        return {"sync/stage_s": t1 - t0, "sync/paused_s": t2 - t1}


class NcclWeightSync:
    """Bucketed broadcast from train rank 0 to every engine over a group of their own.

    The group (rank 0 = train rank 0, ranks 1..n = rollout workers) is set up at the first
    sync from a TCPStore on a free port of train rank 0's node; it is NCCL when the train ranks
    are on GPUs and gloo on CPU. The FSDP default group is never involved. Each sync streams
    the full weights through one reused bucket buffer: one bucket in flight.
    """

    def __init__(
        self,
        cluster: Cluster,
        train: list[RemoteObject],
        rollout_workers: list[RemoteObject],
        rollout: RolloutController,
        bucket_bytes: int,
    ):
        self.cluster, self.train, self.workers = cluster, train, rollout_workers
        self.rollout, self.bucket_bytes = rollout, bucket_bytes
        self.backend = "nccl" if cluster.train[0].spec.gpu_ids else "gloo"
        self.layouts: list[dict] | None = None

    async def connect(self) -> None:
        """Agree on the dtype, plan the buckets and open the group (every member at once)."""
        await match_engine_dtype(self.train, self.workers)
        layouts = await self.train[0].weight_plan(self.bucket_bytes)
        owner = self.cluster.train[0].handle
        host = rendezvous_host(self.cluster)
        port = await owner.call("free_port", {"host": host})
        world = 1 + len(self.workers)
        await asyncio.gather(
            self.train[0].open_weight_group(host, port, world, self.backend),
            *(
                w.open_weight_group(host, port, i + 1, world, self.backend)
                for i, w in enumerate(self.workers)
            ),
        )
        self.layouts = layouts

    async def sync(self, version: int) -> dict:
        """Pause, broadcast every bucket into every engine, resume at ``version``."""
        t0 = time.monotonic()
        if self.layouts is None:
            await self.connect()
        t1 = time.monotonic()
        async with self.rollout.paused(version):
            sent, *_ = await asyncio.gather(
                self.train[0].broadcast_weights(),
                *(w.join_weight_gathers() for w in self.train[1:]),
                *(w.receive_weights(self.layouts) for w in self.workers),
            )
        t2 = time.monotonic()
        return {
            "sync/stage_s": t1 - t0,
            "sync/paused_s": t2 - t1,
            "sync/bytes": sent,
            "sync/gb_per_s": sent / max(t2 - t1, 1e-9) / 1e9,
            "sync/buckets": len(self.layouts),
        }


class IpcWeightSync:
    """Engine and trainer on one GPU: CUDA IPC handles of one bucket buffer at a time.

    For each bucket, train rank 0 fills its CUDA buffer and returns the IPC handle as plain
    fields; every engine maps it, copies into its parameters and returns, which frees the
    buffer for the next bucket. The other train ranks run their all-gathers alongside.
    """

    def __init__(
        self,
        cluster: Cluster,
        train: list[RemoteObject],
        rollout_workers: list[RemoteObject],
        rollout: RolloutController,
        bucket_bytes: int,
    ):
        if not cluster.train[0].spec.gpu_ids:
            raise WeightSyncError(
                "weight_sync.mode=ipc needs the trainer on a GPU (CUDA IPC); on CPU use zmq, "
                "disk or nccl (gloo)"
            )
        self.train, self.workers, self.rollout = train, rollout_workers, rollout
        self.bucket_bytes = bucket_bytes
        self.layouts: list[dict] | None = None

    async def sync(self, version: int) -> dict:
        """Pause, hand every bucket to every engine through CUDA IPC, resume at ``version``."""
        t0 = time.monotonic()
        if self.layouts is None:
            await match_engine_dtype(self.train, self.workers)
            self.layouts = await self.train[0].weight_plan(self.bucket_bytes)
        t1 = time.monotonic()
        async with self.rollout.paused(version):
            await self._transfer()
        t2 = time.monotonic()
        nbytes = sum(b["nbytes"] for b in self.layouts)
        return {
            "sync/stage_s": t1 - t0,
            "sync/paused_s": t2 - t1,
            "sync/bytes": nbytes,
            "sync/gb_per_s": nbytes / max(t2 - t1, 1e-9) / 1e9,
            "sync/buckets": len(self.layouts),
        }

    async def _transfer(self) -> None:
        rank0 = self.train[0]
        followers = [asyncio.ensure_future(w.join_weight_gathers()) for w in self.train[1:]]
        try:
            for i, layout in enumerate(self.layouts):
                handle = await rank0.share_weight_bucket(i)
                await asyncio.gather(*(w.load_weights_ipc(handle, layout) for w in self.workers))
            await rank0.end_weight_share()
            await asyncio.gather(*followers)
        finally:
            for f in followers:
                f.cancel()


async def match_engine_dtype(train: list[RemoteObject], workers: list[RemoteObject]) -> None:
    """Tell the train ranks the engines' weight dtype (from their health), if they report one."""
    healths = await asyncio.gather(*(w.health() for w in workers))
    dtypes = sorted({h["dtype"] for h in healths if h.get("dtype")})
    if len(dtypes) > 1:
        raise WeightSyncError(
            f"the rollout engines hold weights in different dtypes {dtypes}; one weight sync "
            "serves them all, so give every engine the same rollout.dtype"
        )
    if dtypes:
        await asyncio.gather(*(w.set_sync_dtype(dtypes[0]) for w in train))


def rendezvous_host(cluster: Cluster) -> str:
    """The address of train rank 0's node that the other nodes reach (loopback when local)."""
    if "127.0.0.1" in cluster.controller.address:
        return "127.0.0.1"
    return cluster.train[0].handle.info["host"]
