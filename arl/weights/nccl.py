"""``nccl``: train rank 0 broadcasts bucketed weights to every engine over a group of their own.

The group (rank 0 = train rank 0, ranks 1..n = the rollout engines) is opened once from a
TCPStore on a free port of train rank 0's node: NCCL when the train ranks are on GPUs, gloo on
CPU (the stand-in that runs the same code). The FSDP default group is never involved. Each sync
streams the full weights through two alternating bucket buffers per member, so rank 0 gathers
and packs bucket i + 1, and each engine copies bucket i in, while bucket i + 1 is on the wire.
"""

from __future__ import annotations

import asyncio

import torch

from arl.protocol.weight_hooks import WeightSink, WeightSource
from arl.weights.base import (
    ReceiverPart,
    SenderPart,
    WeightSync,
    engine_device,
    rendezvous_host,
)
from arl.weights.buckets import (
    BroadcastGroup,
    BucketLayout,
    broadcast_buckets,
    plan_buckets,
    receive_buckets,
)
from arl.weights.rules import NcclRule


class NcclSync(NcclRule, WeightSync):
    """Controller half: open the group once, then one streamed broadcast per sync."""

    async def setup(self) -> None:
        """Agree on the dtype, plan the buckets and open the group (every member at once)."""
        await super().setup()
        cluster = self.ctx.cluster
        backend = "nccl" if cluster.train[0].spec.gpu_ids else "gloo"
        self.senders = await self.place(NcclSender, cluster.train, host="train")
        self.receivers = await self.place(NcclReceiver, cluster.rollout, host="rollout")
        self.layouts = await self.senders[0].plan(self.ctx.config.bucket_bytes)
        host = rendezvous_host(cluster)
        port = await cluster.train[0].handle.call("free_port", {"host": host})
        world = 1 + len(self.receivers)
        await asyncio.gather(
            self.senders[0].open_group(host, port, 0, world, backend),
            *(r.open_group(host, port, i, world, backend) for i, r in enumerate(self.receivers, 1)),
        )

    async def transfer(self, version: int) -> dict:
        """Rank 0 broadcasts (the other ranks join its gathers); every engine receives."""
        sent, *_ = await asyncio.gather(
            *(s.send() for s in self.senders), *(r.receive(self.layouts) for r in self.receivers)
        )
        return {"sync/bytes": sent, "sync/buckets": len(self.layouts)}


class NcclSender(SenderPart):
    """Train node half: rank 0 is the group's root; the other ranks take part in the gathers."""

    def __init__(self, host: WeightSource) -> None:
        super().__init__(host)
        self.group: BroadcastGroup | None = None
        self.layouts: list[BucketLayout] = []

    def plan(self, bucket_bytes: int) -> list[dict]:
        """Bucket layouts of the full weights in the sync dtype (metadata only, no gathers)."""
        self.layouts = plan_buckets(self.host.weight_specs(), bucket_bytes)
        return [b.to_wire() for b in self.layouts]

    def open_group(self, host: str, port: int, rank: int, world_size: int, backend: str) -> None:
        """Join the broadcast group as its root (blocks until every member joined)."""
        self.group = BroadcastGroup(host, port, rank, world_size, backend)

    def send(self) -> int:
        """Rank 0: broadcast the weights bucket by bucket; others: join the gathers. Bytes sent."""
        if self.host.rank != 0:
            for _ in self.host.full_state():
                pass
            return 0
        if self.group is None or not self.layouts:
            raise RuntimeError("send before plan and open_group")
        return broadcast_buckets(
            self.group, self.host.full_state(), self.layouts, self.host.weights_device
        )

    def close(self) -> None:
        """End the group."""
        if self.group is not None:
            self.group.close()
            self.group = None


class NcclReceiver(ReceiverPart):
    """Rollout node half: a member of the group that copies each bucket into its engine."""

    def __init__(self, host: WeightSink) -> None:
        super().__init__(host)
        self.group: BroadcastGroup | None = None

    def open_group(self, host: str, port: int, rank: int, world_size: int, backend: str) -> None:
        """Join train rank 0's group as ``rank`` (blocks until every member joined)."""
        engine_device(self.host, "nccl")
        self.group = BroadcastGroup(host, port, rank, world_size, backend)

    def receive(self, layouts: list[dict]) -> int:
        """Receive the broadcast into the engine (paused); returns the tensors loaded."""
        if self.group is None:
            raise RuntimeError("receive before open_group")
        device = torch.device(engine_device(self.host, "nccl"))
        plan = [BucketLayout.from_wire(b) for b in layouts]
        n = receive_buckets(self.group, plan, device, self.host.update_weights)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the weights are in place before generation resumes
        return n

    def close(self) -> None:
        """End the group."""
        if self.group is not None:
            self.group.close()
            self.group = None
