"""``ipc_buffer``: engine and trainer on one GPU share one persistent buffer of the weights.

The fastest mode where it runs, and ``auto``'s choice when every engine is on train rank 0's
GPU. At setup, train rank 0 allocates one buffer holding every weight in the engines' dtype
(tied weights once) and exports it once as a CUDA IPC handle (plain msgpack fields, no pickle);
each engine maps it once and keeps views of its tensors. On CPU (asked for by name; ``auto``
keeps zmq there) the buffer is a shared-memory file that the engines map instead. Per sync:

- stage (rollout still running): rank 0 casts its weights into the buffer in one multi-tensor
  copy (one rank: straight from its shards, no gather; more ranks: the gathered tensors);
- transfer (rollout paused): each engine copies the views into its parameters on the device,
  in place, so its CUDA graphs stay valid. Only a small call crosses the socket each way.

The floor is two device copies of the weights (trainer -> buffer, buffer -> engine); the
price is one extra copy of the weights in GPU memory (``ipc`` streams one bucket instead).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import secrets
import sys
import weakref
from typing import Any

import torch

from arl.protocol.weight_hooks import WeightSink, WeightSource
from arl.weights.base import (
    ReceiverPart,
    SenderPart,
    WeightSync,
    engine_device,
)
from arl.weights.buckets import (
    BucketLayout,
    WeightTransferError,
    open_cuda_buffer,
    plan_buckets,
    share_cuda_buffer,
    unflatten_bucket,
)
from arl.weights.rules import IpcBufferRule


class IpcBufferSync(IpcBufferRule, WeightSync):
    """Controller half: share the buffer once; per sync one stage call and one load call."""

    async def setup(self) -> None:
        """Agree on the dtype, allocate and share the buffer, let every engine map it."""
        await super().setup()
        cluster = self.ctx.cluster
        self.senders = await self.place(BufferSender, cluster.train, host="train")
        self.receivers = await self.place(BufferReceiver, cluster.rollout, host="rollout")
        shared = await self.senders[0].open()
        self.nbytes = int(shared["layout"]["nbytes"])
        await asyncio.gather(*(r.open(shared) for r in self.receivers))
        await self.senders[0].opened()

    async def stage(self, version: int) -> dict:
        """Rank 0 casts the current weights into the buffer (the other ranks join the gathers)."""
        await asyncio.gather(*(s.stage() for s in self.senders))
        return {"sync/bytes": self.nbytes}

    async def transfer(self, version: int) -> None:
        """Every engine copies the buffer into its parameters."""
        await asyncio.gather(*(r.load() for r in self.receivers))


class BufferSender(SenderPart):
    """Train node half: rank 0 owns the buffer; every rank takes part in filling it."""

    def __init__(self, host: WeightSource) -> None:
        super().__init__(host)
        self.buffer: torch.Tensor | None = None
        self.views: dict[str, torch.Tensor] = {}
        self._named: list | None = None
        self._sources: list[torch.Tensor] = []
        self._shm_path: str | None = None  # the CPU buffer's file until the engines mapped it

    def open(self) -> dict | None:
        """Rank 0: allocate the buffer, return its layout, tied names and handle fields."""
        if self.host.rank != 0:
            return None
        device = torch.device(self.host.weights_device)
        tied = self.host.tied_weights()  # alias -> the name that holds the tensor
        specs = [s for s in self.host.weight_specs() if s[0] not in tied]
        (layout,) = plan_buckets(specs, sys.maxsize)  # one bucket: the whole model
        if device.type == "cuda":
            self.buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
            handle = {"cuda": share_cuda_buffer(self.buffer)}
            torch.cuda.synchronize(device)
        else:
            self.buffer, handle = _new_shared_file(layout.nbytes)
            self._shm_path = handle["file"]
            # Unlinked once mapped (`opened`); this covers a node that exits before that.
            weakref.finalize(self, _unlink_quietly, self._shm_path)
        self.views = dict(unflatten_bucket(layout, self.buffer))
        return {"layout": layout.to_wire(), "tied": tied, "handle": handle}

    def opened(self) -> None:
        """Every engine has mapped the buffer: a shared file needs no name any more."""
        path, self._shm_path = self._shm_path, None
        if path:
            _unlink_quietly(path)

    def stage(self) -> None:
        """Cast the current weights into the buffer and wait for the copy (every rank calls)."""
        sources = self._current_sources()
        if sources is not None:  # one rank: its shards are the whole tensors
            torch._foreach_copy_(list(self.views.values()), sources)
        else:
            for name, t in self.host.full_state():
                view = self.views.get(name)
                if view is not None:  # rank 0; tied aliases are skipped
                    view.copy_(t)
        if self.buffer is not None and self.buffer.is_cuda:
            # The engines read through their own processes: the bytes must be in place first.
            torch.cuda.synchronize(self.buffer.device)

    def _current_sources(self) -> list[torch.Tensor] | None:
        """Rank 0's unsharded source tensors in buffer order, or None when the weights need
        gathering (more ranks)."""
        if self.buffer is None:
            return None
        named = self.host.weight_sources()  # the same list while the weights stay put
        if named is None:
            return None
        if named is not self._named:
            by_name = dict(named)
            self._named, self._sources = named, [by_name[name] for name in self.views]
        return self._sources

    def close(self) -> None:
        """Free the buffer (CUDA, or the kernel, keeps it until every engine has unmapped it)."""
        self.opened()  # a setup that failed before the engines mapped it leaves the file
        cuda = self.buffer is not None and self.buffer.is_cuda
        self.buffer, self.views, self._named, self._sources = None, {}, None, []
        if cuda:
            torch.cuda.ipc_collect()


class BufferReceiver(ReceiverPart):
    """Rollout node half: maps the buffer once; each load copies it into the engine."""

    def __init__(self, host: WeightSink) -> None:
        super().__init__(host)
        self.buffer: Any = None
        self.named: list[tuple[str, torch.Tensor]] = []

    def open(self, shared: dict) -> int:
        """Map rank 0's buffer and bind the engine's names (tied aliases too) to its views."""
        device = torch.device(engine_device(self.host, IpcBufferSync.mode))
        layout = BucketLayout.from_wire(shared["layout"])
        handle = shared["handle"]
        if "cuda" in handle:
            self.buffer = open_cuda_buffer(handle["cuda"])
        else:
            self.buffer = _map_shared_file(handle["file"], layout.nbytes)
        if self.buffer.device != device:
            raise WeightTransferError(
                f"train rank 0's buffer is on {self.buffer.device}, the engine on {device}: "
                "weight_sync.mode=ipc_buffer needs both on one GPU (use nccl across GPUs)"
            )
        views = dict(unflatten_bucket(layout, self.buffer))
        tied = [(alias, views[name]) for alias, name in shared["tied"].items()]
        self.named = [*views.items(), *tied]
        return len(self.named)

    def load(self) -> int:
        """Copy the buffer into the engine's parameters (engine paused); returns the tensors
        copied once the copies are done, so the trainer may refill the buffer."""
        if self.buffer is None:
            raise RuntimeError("load before open")
        n = self.host.update_weights(self.named)
        if self.buffer.is_cuda:
            torch.cuda.synchronize(self.buffer.device)
        return n

    def close(self) -> None:
        """Unmap the buffer."""
        self.named, self.buffer = [], None


# ---- the CPU buffer: a shared-memory file --------------------------------------------------
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


def _new_shared_file(nbytes: int) -> tuple[torch.Tensor, dict]:
    """A ``uint8`` tensor over a new 0600 shared-memory file, and the fields naming it."""
    path = os.path.join(SHM_DIR, f"arl-weights-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        mm = mmap.mmap(fd, max(nbytes, 1))  # MAP_SHARED: the engines see every write
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8)[:nbytes], {"file": path}


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _map_shared_file(path: str, nbytes: int) -> torch.Tensor:
    """Map train rank 0's shared file (same host); a ``uint8`` tensor over it."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise WeightTransferError(
            f"train rank 0's weight buffer {path} is not on this host: weight_sync.mode="
            "ipc_buffer without GPUs needs every engine on train rank 0's host (use zmq)"
        ) from None
    try:
        mm = mmap.mmap(fd, max(nbytes, 1))
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8)[:nbytes]
