"""``zmq``: the full weights as buckets through the data plane (works anywhere, CPU included).

Train rank 0 puts the weights into its node's shard store as buckets of about
``weight_sync.bucket_bytes``; each rollout node pulls them (shared memory on the same host,
zero-copy frames otherwise) and copies them into its engine; the buckets are freed after.
"""

from __future__ import annotations

import asyncio

import torch

from arl.protocol.hosting import NodeContext, UsesNode
from arl.protocol.rtensor import RTensor, ShardRef
from arl.protocol.weight_hooks import WeightSource
from arl.weights.base import ReceiverPart, SenderPart, WeightSync
from arl.weights.rules import ZmqRule


class ZmqSync(ZmqRule, WeightSync):
    """Controller half: publish on rank 0, pull into every engine, free the buckets."""

    async def setup(self) -> None:
        """Agree on the dtype; place the senders (every train rank) and receivers."""
        await super().setup()
        self.senders = await self.place(ZmqSender, self.ctx.cluster.train, host="train")
        self.receivers = await self.place(ZmqReceiver, self.ctx.cluster.rollout, host="rollout")
        self.buckets: RTensor | None = None

    async def stage(self, version: int) -> dict:
        """Rank 0 puts the buckets into its store (the other ranks join the gathers)."""
        bucket_bytes = self.ctx.config.bucket_bytes
        metas = await asyncio.gather(
            *(s.publish(f"weights/v{version}", bucket_bytes) for s in self.senders)
        )
        owner = self.ctx.cluster.train[0].handle
        refs = [ShardRef.from_meta(owner.node_id, m) for m in metas[0]]
        self.buckets = RTensor(refs, peers={owner.node_id: owner.info["data_addr"]})
        return {"sync/bytes": self.buckets.nbytes}

    async def transfer(self, version: int) -> None:
        """Every engine pulls the buckets and copies them in."""
        wire = self.buckets.to_wire()
        await asyncio.gather(*(r.load(wire) for r in self.receivers))

    async def cleanup(self, version: int) -> None:
        """Free the buckets on rank 0 and on every node that pulled a copy."""
        buckets, self.buckets = self.buckets, None
        if buckets is not None:
            await self.ctx.free(list(buckets.refs))


class ZmqSender(SenderPart, UsesNode):
    """Train node half: the full weights into the node's shard store as buckets (rank 0)."""

    def __init__(self, host: WeightSource, node: NodeContext) -> None:
        super().__init__(host)
        self.node = node
        self._tied: dict[str, str] | None = None  # the host's tied aliases, read once

    def publish(self, key_prefix: str, bucket_bytes: int) -> list[dict]:
        """Every rank calls it (the gathers are collective); returns rank 0's bucket metas."""
        store, rank0 = self.node.store, self.host.rank == 0
        metas, bucket, size = [], {}, 0
        # A tied alias (lm_head of tied embeddings) is the tensor of the name it aliases, in
        # the engine too: sending that name updates both (the ipc_buffer mode's rule as well).
        if self._tied is None:
            self._tied = self.host.tied_weights() if rank0 else {}
        tied = self._tied
        for name, t in self.host.full_state():
            if not rank0 or name in tied:  # every rank iterates: the gathers are collective
                continue
            # A copy: with one train rank `full_state` yields views of the live weights.
            bucket[name] = t.detach().to("cpu", copy=True).contiguous()
            size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                metas.append(store.put(f"{key_prefix}/{len(metas)}", bucket).to_wire())
                bucket, size = {}, 0
        if bucket:
            metas.append(store.put(f"{key_prefix}/{len(metas)}", bucket).to_wire())
        return metas


class ZmqReceiver(ReceiverPart):
    """Rollout node half: the pulled buckets (the node materialises the RTensor argument)."""

    def load(self, buckets: list[dict[str, torch.Tensor]]) -> int:
        """Copy the buckets into the engine (paused); returns the tensors copied."""
        named = [(name, t) for bucket in buckets for name, t in bucket.items()]
        return self.host.update_weights(named)
