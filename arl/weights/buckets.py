"""What the weight-sync plug-ins share: bucket layouts, a broadcast group of their own, and
CUDA IPC handles as plain values (DESIGN §6).

A *bucket* is a run of consecutive named tensors packed into one contiguous ``uint8`` buffer,
each at an aligned byte offset. Its `BucketLayout` (a `TensorSlot` per tensor) is a wire
struct: the sender fills the buffer with `flatten_bucket`, the buffer crosses (an NCCL/gloo
broadcast, or a CUDA IPC mapping), and the receiver takes zero-copy views of it with
`unflatten_bucket` and copies them into its engine. The broadcast keeps two buffers, so the
sender packs bucket i + 1 and each receiver copies bucket i while bucket i + 1 is on the wire.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal

import attrs
import torch

from arl.protocol.shards import TensorSlot
from arl.protocol.wire import WireStruct
from arl.wire.codec import dtype_name, parse_dtype
from arl.wire.rendezvous import tcp_store

# Byte alignment of every tensor in a bucket: any dtype view of a slice is then aligned, and
# CUDA copies run on aligned addresses.
ALIGN = 256
GroupBackend = Literal["gloo", "nccl"]


class WeightTransferError(RuntimeError):
    """Weights could not be moved: the two sides disagree on the layout, or the link failed."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@attrs.frozen
class BucketLayout(WireStruct):
    """The tensors of one bucket, in order, and the buffer size they need.

    A wire struct: the receiver needs nothing else to unpack the buffer, and decoding checks
    that every slot fits in ``nbytes``.
    """

    slots: tuple[TensorSlot, ...]
    nbytes: int

    def __attrs_post_init__(self) -> None:
        for s in self.slots:
            if s.offset < 0 or s.offset + s.nbytes > self.nbytes:
                raise WeightTransferError(
                    f"bucket slot {s.name!r} at offset {s.offset} ({s.nbytes} bytes) does not fit "
                    f"in a {self.nbytes}-byte bucket: sender and receiver disagree on the layout"
                )


def plan_buckets(
    specs: Iterable[tuple[str, Sequence[int], torch.dtype]], bucket_bytes: int
) -> list[BucketLayout]:
    """Group ``(name, shape, dtype)`` in order into buckets holding at most ``bucket_bytes``.

    A tensor larger than ``bucket_bytes`` gets a bucket of its own. Order is kept, so a sender
    can fill the buckets from one streamed pass over the weights.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    layouts: list[BucketLayout] = []
    slots: list[TensorSlot] = []
    used = 0
    for name, shape, dtype in specs:
        slot = TensorSlot.of(name, dtype_name(dtype), tuple(int(d) for d in shape))
        if slots and used + slot.nbytes > bucket_bytes:
            layouts.append(BucketLayout(tuple(slots), used))
            slots, used = [], 0
        slots.append(attrs.evolve(slot, offset=used))
        used = _align(used + slot.nbytes)
    if slots:
        layouts.append(BucketLayout(tuple(slots), used))
    return layouts


def new_bucket_buffer(layouts: Sequence[BucketLayout], device: torch.device | str) -> torch.Tensor:
    """One ``uint8`` buffer large enough for the largest bucket of ``layouts``."""
    size = max((b.nbytes for b in layouts), default=0)
    return torch.empty(size, dtype=torch.uint8, device=device)


def flatten_bucket(
    layout: BucketLayout, tensors: Sequence[torch.Tensor], out: torch.Tensor
) -> torch.Tensor:
    """Copy ``tensors`` (in slot order, cast to each slot's dtype) into ``out``; returns the
    filled prefix ``out[:layout.nbytes]``. Copies are asynchronous on CUDA."""
    if len(tensors) != len(layout.slots):
        raise WeightTransferError(f"bucket expects {len(layout.slots)} tensors, got {len(tensors)}")
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < layout.nbytes:
        raise ValueError(
            f"out must be a 1-D uint8 buffer of >= {layout.nbytes} bytes, got "
            f"{out.dtype} {tuple(out.shape)}"
        )
    for slot, t in zip(layout.slots, tensors, strict=True):
        if tuple(t.shape) != slot.shape:
            raise WeightTransferError(
                f"tensor {slot.name!r} has shape {tuple(t.shape)}, the bucket layout says "
                f"{slot.shape}: the weights changed shape since the layout was planned"
            )
        _slot_view(out, slot).copy_(t.detach(), non_blocking=True)
    return out[: layout.nbytes]


def unflatten_bucket(layout: BucketLayout, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Named views (no copy) of the tensors packed in ``buffer`` by `flatten_bucket`."""
    if buffer.dtype != torch.uint8 or buffer.numel() < layout.nbytes:
        raise ValueError(
            f"buffer must be uint8 with >= {layout.nbytes} bytes, got {buffer.dtype} "
            f"{tuple(buffer.shape)}"
        )
    return [(slot.name, _slot_view(buffer, slot)) for slot in layout.slots]


def _slot_view(buffer: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    raw = buffer[slot.offset : slot.offset + slot.nbytes]
    return raw.view(parse_dtype(slot.dtype)).view(slot.shape)


def iter_buckets(
    named: Iterable[tuple[str, torch.Tensor]], layouts: Sequence[BucketLayout]
) -> Iterator[tuple[BucketLayout, list[torch.Tensor]]]:
    """Group a streamed ``(name, tensor)`` pass into the planned buckets, checking the names.

    Consumes ``named`` lazily: bucket i is yielded as soon as its last tensor arrives.
    """
    stream = iter(named)
    for layout in layouts:
        tensors = []
        for slot in layout.slots:
            item = next(stream, None)
            if item is None:
                raise WeightTransferError(
                    f"the weights ended before {slot.name!r}: the model has fewer tensors "
                    "than when the bucket layout was planned"
                )
            name, t = item
            if name != slot.name:
                raise WeightTransferError(
                    f"expected weight {slot.name!r} next, got {name!r}: the state dict order "
                    "changed since the bucket layout was planned"
                )
            tensors.append(t)
        yield layout, tensors
    extra = next(stream, None)
    if extra is not None:
        raise WeightTransferError(
            f"weight {extra[0]!r} is not in any bucket: the model has more tensors than when "
            "the bucket layout was planned"
        )


# ---- a broadcast group of its own -------------------------------------------------------------
class BroadcastGroup:
    """A process group between train rank 0 (rank 0) and the rollout engines (ranks 1..n).

    Built directly from a `TCPStore` and `ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (CUDA),
    never through ``init_process_group``: the train ranks' default (FSDP) group stays untouched.
    Construction blocks until every rank has joined, so all ranks must construct it at once.
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: GroupBackend | str,
        timeout_s: float = 600.0,
    ) -> None:
        import torch.distributed as dist

        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.store = tcp_store(host, port, world_size, rank == 0, timeout)  # binds host only
        if backend == "nccl":
            if not hasattr(dist, "ProcessGroupNCCL"):
                raise WeightTransferError(
                    "weight_sync.mode=nccl with GPUs needs a torch built with NCCL; this one has "
                    "none (use weight_sync.mode=zmq)"
                )
            # NVLink SHARP (multicast) objects cannot be created on the lent machines.
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg: Any = dist.ProcessGroupNCCL(self.store, rank, world_size, opts)
        elif backend == "gloo":
            self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
        else:
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        # Rendezvous now rather than at the first broadcast, so a missing rank fails here.
        self.barrier()

    def barrier(self) -> None:
        """Wait for every rank (a one-element broadcast: works the same on gloo and NCCL)."""
        device = "cuda" if self.backend == "nccl" else "cpu"
        self.broadcast(torch.zeros(1, dtype=torch.uint8, device=device))

    def broadcast(self, buffer: torch.Tensor) -> None:
        """Broadcast ``buffer`` from rank 0 into every other rank's ``buffer``, in place."""
        self.broadcast_async(buffer).wait()

    def broadcast_async(self, buffer: torch.Tensor) -> Any:
        """Start the broadcast of ``buffer``; returns its ``Work`` (``wait()`` before reusing
        ``buffer``; on CUDA that orders the current stream after it, the host goes on)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self.pg.broadcast([buffer], opts)

    def close(self) -> None:
        """End the group (its communicators) and the store."""
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None and self.backend == "nccl":
            shutdown()
        self.pg = None
        self.store = None


def broadcast_buckets(
    group: BroadcastGroup,
    named: Iterable[tuple[str, torch.Tensor]],
    layouts: Sequence[BucketLayout],
    device: torch.device | str,
) -> int:
    """Rank 0: stream ``named`` bucket by bucket through two alternating buffers; returns bytes
    sent. Bucket i + 1 is gathered and packed while bucket i is broadcast: a buffer is refilled
    only once its previous broadcast is done (on CUDA, `Work.wait` orders the streams, the host
    does not block)."""
    buffers = [new_bucket_buffer(layouts, device) for _ in range(min(2, len(layouts)))]
    pending: list[Any] = [None] * len(buffers)
    sent = 0
    try:
        for i, (layout, tensors) in enumerate(iter_buckets(named, layouts)):
            k = i % len(buffers)
            if pending[k] is not None:
                pending[k].wait()
            pending[k] = group.broadcast_async(flatten_bucket(layout, tensors, buffers[k]))
            sent += layout.nbytes
    finally:
        for work in pending:
            if work is not None:
                work.wait()
    return sent


def receive_buckets(
    group: BroadcastGroup,
    layouts: Sequence[BucketLayout],
    device: torch.device | str,
    load: Any,
) -> int:
    """Ranks 1..n: receive every bucket into two alternating buffers, handing each bucket's
    named views to ``load(named) -> int``; returns the tensors loaded.

    The receive of bucket i + 1 is posted before bucket i is loaded, so the copy into the
    engine overlaps the transfer (NCCL orders its stream after the earlier copies out of the
    buffer it reuses). Every bucket is received even after ``load`` fails, so the sender never
    hangs; the first failure is raised at the end.
    """
    buffers = [new_bucket_buffer(layouts, device) for _ in range(min(2, len(layouts)))]

    def post(i: int) -> Any:
        return group.broadcast_async(buffers[i % len(buffers)][: layouts[i].nbytes])

    works = {0: post(0)} if layouts else {}
    loaded, error = 0, None
    for i, layout in enumerate(layouts):
        if i + 1 < len(layouts):
            works[i + 1] = post(i + 1)
        works.pop(i).wait()
        if error is None:
            try:
                filled = buffers[i % len(buffers)][: layout.nbytes]
                loaded += load(unflatten_bucket(layout, filled))
            except Exception as e:  # noqa: BLE001 - re-raised once the stream is drained
                error = e
    if error is not None:
        raise error
    return loaded


# ---- CUDA IPC handles as plain values ---------------------------------------------------------
def share_cuda_buffer(buffer: torch.Tensor) -> dict:
    """Export a CUDA tensor as msgpack-able fields another process on the host can map.

    The fields are those of ``torch.multiprocessing.reductions.reduce_tensor`` minus the
    classes (which the receiver knows): raw handles are bytes, the rest ints, strs and bools.
    The caller must keep ``buffer`` alive, unchanged, until the receiver has acknowledged.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    if buffer.device.type != "cuda":
        raise WeightTransferError(
            f"CUDA IPC needs a CUDA tensor, got one on {buffer.device}; the ipc weight-sync "
            "modes work only with GPUs (use zmq on CPU)"
        )
    _, args = reduce_tensor(buffer)
    (
        _cls,
        size,
        stride,
        tensor_offset,
        _storage_cls,
        dtype,
        device,
        handle,
        storage_bytes,
        storage_offset,
        _requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = args
    return {
        "size": list(size),
        "stride": list(stride),
        "tensor_offset": int(tensor_offset),
        "dtype": dtype_name(dtype),
        "device_uuid": str(torch.cuda.get_device_properties(device).uuid),
        "handle": bytes(handle),
        "storage_bytes": int(storage_bytes),
        "storage_offset": int(storage_offset),
        "ref_counter_handle": bytes(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": None if event_handle is None else bytes(event_handle),
        "event_sync_required": bool(event_sync_required),
    }


def open_cuda_buffer(fields: dict) -> torch.Tensor:
    """Map a buffer exported by `share_cuda_buffer` in this process (same physical GPU)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device = local_cuda_index(fields["device_uuid"])
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(fields["size"]),
        tuple(fields["stride"]),
        fields["tensor_offset"],
        torch.UntypedStorage,
        parse_dtype(fields["dtype"]),
        device,
        fields["handle"],
        fields["storage_bytes"],
        fields["storage_offset"],
        False,
        fields["ref_counter_handle"],
        fields["ref_counter_offset"],
        fields["event_handle"],
        fields["event_sync_required"],
    )


def local_cuda_index(uuid: str) -> int:
    """This process's index of the GPU with ``uuid`` (CUDA_VISIBLE_DEVICES renumbers GPUs)."""
    if not torch.cuda.is_available():
        raise WeightTransferError("CUDA IPC needs CUDA in the receiving process; none is visible")
    seen = []
    for i in range(torch.cuda.device_count()):
        u = str(torch.cuda.get_device_properties(i).uuid)
        if u == uuid:
            return i
        seen.append(u)
    raise WeightTransferError(
        f"GPU {uuid} holding the trainer's buffer is not visible here (visible: {seen}); "
        "the ipc weight-sync modes need the engine on the same GPU as train rank 0 (use nccl "
        "for separate GPUs)"
    )
