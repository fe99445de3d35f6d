"""``ipc``: engine and trainer on one GPU, one CUDA bucket buffer shared per bucket.

For each bucket, train rank 0 fills its CUDA buffer and returns the IPC handle as plain msgpack
fields (no pickle); every engine maps it, copies into its parameters and returns, which frees
the buffer for the next bucket. The extra GPU memory is one bucket, not one model, at the price
of one round trip and one mapping per bucket per sync (``ipc_buffer`` is the fast one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from arl.protocol.weight_hooks import WeightSource
from arl.weights.base import (
    ReceiverPart,
    SenderPart,
    WeightSync,
    engine_device,
)
from arl.weights.buckets import (
    BucketLayout,
    WeightTransferError,
    flatten_bucket,
    iter_buckets,
    new_bucket_buffer,
    open_cuda_buffer,
    plan_buckets,
    share_cuda_buffer,
    unflatten_bucket,
)
from arl.weights.rules import IpcRule


class IpcSync(IpcRule, WeightSync):
    """Controller half: one handle per bucket from rank 0 to every engine, in order."""

    async def setup(self) -> None:
        """Agree on the dtype, place the halves, plan the buckets."""
        await super().setup()
        cluster = self.ctx.cluster
        self.senders = await self.place(IpcSender, cluster.train, host="train")
        self.receivers = await self.place(IpcReceiver, cluster.rollout, host="rollout")
        self.layouts = await self.senders[0].plan(self.ctx.config.bucket_bytes)

    async def transfer(self, version: int) -> dict:
        """Hand every bucket to every engine; the other train ranks join the gathers."""
        rank0 = self.senders[0]
        followers = [asyncio.ensure_future(s.join_gathers()) for s in self.senders[1:]]
        try:
            for i, layout in enumerate(self.layouts):
                handle = await rank0.share(i)
                await asyncio.gather(*(r.load(handle, layout) for r in self.receivers))
            await rank0.finish()
            await asyncio.gather(*followers)
        finally:
            for f in followers:
                f.cancel()
        nbytes = sum(b["nbytes"] for b in self.layouts)
        return {"sync/bytes": nbytes, "sync/buckets": len(self.layouts)}


class _BucketStream:
    """Rank 0's pass over the weights for one sync: fills the one buffer bucket by bucket."""

    def __init__(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        layouts: Sequence[BucketLayout],
        device: torch.device,
    ) -> None:
        if device.type != "cuda":
            raise WeightTransferError(
                f"weight_sync.mode=ipc needs the trainer on a GPU, it is on {device}; "
                "use zmq or nccl (gloo) on CPU"
            )
        self.buckets = iter_buckets(named, layouts)
        self.buffer: torch.Tensor | None = new_bucket_buffer(layouts, device)
        self.device = device
        self.n_buckets, self.next_index = len(layouts), 0

    def share(self, index: int) -> dict:
        """Fill the buffer with bucket ``index`` (0, 1, ... in order) and export it."""
        if index != self.next_index or self.buffer is None:
            raise WeightTransferError(
                f"bucket {index} asked for, but bucket {self.next_index} of {self.n_buckets} is "
                "next: buckets are shared in order, each once"
            )
        layout, tensors = next(self.buckets)
        filled = flatten_bucket(layout, tensors, self.buffer)
        # The receiver reads through its own stream: the bytes must be in place before it maps.
        torch.cuda.synchronize(self.device)
        self.next_index += 1
        return {**share_cuda_buffer(filled), "bucket": index}

    def finish(self) -> None:
        """Check that every bucket went out, then `release`."""
        done = self.next_index == self.n_buckets
        try:
            if done:
                next(self.buckets, None)  # runs the "no tensor left over" check
        finally:
            self.release()
        if not done:
            raise WeightTransferError(
                f"weight share ended after {self.next_index} of {self.n_buckets} buckets"
            )

    def release(self) -> None:
        """Stop the weight pass and free the buffer (once the receivers have let go of it)."""
        self.buckets.close()
        self.buffer = None
        torch.cuda.ipc_collect()


class IpcSender(SenderPart):
    """Train node half: rank 0 shares bucket after bucket; the other ranks join the gathers."""

    def __init__(self, host: WeightSource) -> None:
        super().__init__(host)
        self.layouts: list[BucketLayout] = []
        self.stream: _BucketStream | None = None

    def plan(self, bucket_bytes: int) -> list[dict]:
        """Bucket layouts of the full weights in the sync dtype (metadata only, no gathers)."""
        self.layouts = plan_buckets(self.host.weight_specs(), bucket_bytes)
        return [b.to_wire() for b in self.layouts]

    def share(self, index: int) -> dict:
        """Rank 0: fill the buffer with bucket ``index`` and return its IPC handle fields."""
        if index == 0:
            if self.stream is not None:  # left behind by a sync that failed midway
                self.stream.release()
            self.stream = _BucketStream(
                self.host.full_state(), self.layouts, self.host.weights_device
            )
        if self.stream is None:
            raise RuntimeError(f"share({index}) before bucket 0")
        return self.stream.share(index)

    def finish(self) -> None:
        """Rank 0: check every bucket was shared and release the buffer."""
        stream, self.stream = self.stream, None
        if stream is not None:
            stream.finish()

    def join_gathers(self) -> None:
        """Ranks > 0: take part in the all-gathers of rank 0's pass over the weights."""
        for _ in self.host.full_state():
            pass

    def close(self) -> None:
        """Release a buffer left by a failed sync."""
        if self.stream is not None:
            self.stream.release()
            self.stream = None


class IpcReceiver(ReceiverPart):
    """Rollout node half: maps each shared bucket and copies it into the engine."""

    def load(self, fields: dict, layout: dict) -> int:
        """Copy the bucket named by ``fields`` into the engine (paused) and wait for the copies:
        the return acknowledges that the sender may reuse the buffer."""
        engine_device(self.host, "ipc")
        bucket = BucketLayout.from_wire(layout)
        buffer: Any = open_cuda_buffer(fields)
        try:
            n = self.host.update_weights(unflatten_bucket(bucket, buffer))
            torch.cuda.synchronize(buffer.device)
        finally:
            del buffer
        return n
