"""One node's shard store: trajectories kept by key, in shared memory, freed explicitly (DESIGN §3).

A shard is a dict of tensors (one trajectory or prompt group, padding trimmed). The store copies
its tensors contiguously into one buffer, each at a 64-byte aligned offset. With shared memory on
(the default) that buffer is a file ``/dev/shm/arl-<run_id>-<pid>-<n>``, so a consumer on the same
host maps it instead of receiving it through a socket. Under POSIX a mapping outlives the file's
name: the owner unlinks on ``free``, on ``close()`` and at interpreter exit, and a consumer's
mapping stays valid until the consumer drops it. Segments of an owner killed with SIGKILL are
removed by ``sweep_orphans`` (each node calls it when it starts).

Stored shards are immutable: ``get`` returns views of the store's buffer.

Private buffers (pulled copies, and shards kept without shared memory) are recycled through a
bounded pool when freed and no tensor still views them: fresh memory costs a page fault per
4 KiB, which on a VM made a pull several times slower than the socket it came through.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs
import torch

from arl.protocol.shards import ShardMeta, TensorSlot
from arl.wire.codec import dtype_name, parse_dtype

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
DEFAULT_POOL_BYTES = 2 << 30
ALIGN = 64  # every tensor starts on a cache line, so any dtype views it without a copy
# madvise advice values (linux >= 5.14); Python 3.11's mmap module does not name them.
_MADV_POPULATE_READ = 22
_MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_segment_numbers = itertools.count()  # next() on a count is atomic under the GIL
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


class ShardNotFound(KeyError):
    """A key the store does not hold (never stored, or already freed)."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


class ShardExists(ValueError):
    """``put`` of a key the store already holds; shard keys must be unique per node."""


@attrs.define(eq=False)
class StoredShard:
    """A held shard: metadata, the buffer its tensors view, and the shm file it owns (if any)."""

    meta: ShardMeta
    slots: list[TensorSlot]
    buffer: mmap.mmap  # may be longer than ``size`` when it came from the pool
    size: int  # bytes of the shard's layout, alignment padding included
    segment: str | None  # name under SHM_DIR that this store created and must unlink
    tensors: dict[str, torch.Tensor]
    pooled: bool = False  # a private buffer that goes back to the pool when freed


def plan_layout(shard: Mapping[str, torch.Tensor]) -> tuple[list[TensorSlot], int]:
    """Aligned slots for the tensors of ``shard`` and the total buffer size they need."""
    slots, offset = [], 0
    for name, t in shard.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(
                f"a shard maps str to torch.Tensor; entry {name!r} is {type(t).__name__}"
            )
        nbytes = t.numel() * t.element_size()
        slots.append(TensorSlot(name, dtype_name(t.dtype), tuple(t.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return slots, max(offset, 1)  # mmap refuses length 0


def count_tokens(shard: Mapping[str, torch.Tensor]) -> int:
    """Sum of ``attention_mask`` when present, else numel of ``input_ids``, else 0."""
    if "attention_mask" in shard:
        return int(shard["attention_mask"].sum().item())
    if "input_ids" in shard:
        return shard["input_ids"].numel()
    return 0


def tensor_views(buffer: mmap.mmap, slots: Iterable[TensorSlot]) -> dict[str, torch.Tensor]:
    """Tensors over ``buffer`` at ``slots`` (no copy; they keep the buffer alive)."""
    out = {}
    for s in slots:
        dtype = parse_dtype(s.dtype)
        numel = 1
        for d in s.shape:
            numel *= d
        if numel == 0:
            out[s.name] = torch.empty(s.shape, dtype=dtype)
            continue
        if s.offset < 0 or s.offset + s.nbytes > len(buffer):
            raise ValueError(
                f"tensor {s.name!r} at [{s.offset}, {s.offset + s.nbytes}) lies outside a "
                f"buffer of {len(buffer)} bytes"
            )
        t = torch.frombuffer(buffer, dtype=dtype, count=numel, offset=s.offset)
        if t.nbytes != s.nbytes:
            raise ValueError(f"tensor {s.name!r}: {s.nbytes} bytes declared, {t.nbytes} implied")
        out[s.name] = t.view(s.shape)
    return out


def madvise(buffer: mmap.mmap, advice: int) -> bool:
    """madvise(2) without holding the GIL; False where the kernel does not know ``advice``."""
    if len(buffer) == 0:
        return True
    anchor = ctypes.c_char.from_buffer(buffer)
    try:
        return _libc.madvise(ctypes.addressof(anchor), len(buffer), advice) == 0
    finally:
        del anchor  # releases the buffer export so the mmap can be dropped later


def map_segment(name: str, size: int, shm_dir: str = SHM_DIR) -> mmap.mmap:
    """Map another process's segment copy-on-write: writes stay private, the owner's bytes safe.

    Raises FileNotFoundError when the owner has already unlinked it.
    """
    fd = os.open(os.path.join(shm_dir, name), os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    # Fault every page in with one syscall instead of one fault per 4 KiB on first touch.
    madvise(mm, _MADV_POPULATE_READ)
    return mm


def size_class(n: int) -> int:
    """Pool size class of an ``n``-byte buffer: page multiples, at most 25% above ``n``."""
    n = max(n, mmap.PAGESIZE)
    step = max(1 << max(n.bit_length() - 3, 0), mmap.PAGESIZE)
    return -(-n // step) * step


class BufferPool:
    """Freed private buffers by size class, up to ``max_bytes`` in all (thread-safe)."""

    def __init__(self, max_bytes: int = DEFAULT_POOL_BYTES):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()

    def take(self, size: int) -> tuple[mmap.mmap, bool]:
        """A buffer of at least ``size`` bytes, and whether it was recycled."""
        cls = size_class(size)
        with self._lock:
            bufs = self._free.get(cls)
            if bufs:
                self.bytes -= cls
                return bufs.pop(), True
        buf = mmap.mmap(-1, cls)
        if cls >= 2 << 20:  # huge pages where the kernel grants them: 512x fewer faults
            buf.madvise(mmap.MADV_HUGEPAGE)
        return buf, False

    def give(self, buf: mmap.mmap) -> bool:
        """Keep ``buf`` for reuse unless the pool is full; the caller must drop every view."""
        cls = len(buf)
        with self._lock:
            if size_class(cls) != cls or self.bytes + cls > self.max_bytes:
                return False
            self._free.setdefault(cls, []).append(buf)
            self.bytes += cls
        return True

    def clear(self) -> None:
        """Drop every pooled buffer."""
        with self._lock:
            self._free.clear()
            self.bytes = 0


def _unlink_all(paths: set[str], pid: int) -> None:
    if os.getpid() != pid:  # a forked child must not remove its parent's segments
        return
    for p in list(paths):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
        paths.discard(p)


class ShardStore:
    """A node's shards by key, with bytes-held and shard-count gauges (thread-safe)."""

    def __init__(
        self,
        run_id: str,
        node_id: str = "",
        *,
        shared_memory: bool = True,
        shm_dir: str = SHM_DIR,
        pool_bytes: int = DEFAULT_POOL_BYTES,
    ):
        if not run_id or "/" in run_id:
            raise ValueError(f"run_id must be a non-empty name without '/', got {run_id!r}")
        self.run_id = run_id
        self.node_id = node_id or f"pid{os.getpid()}"
        self.shared_memory = shared_memory and os.path.isdir(shm_dir)
        self.shm_dir = shm_dir
        self._pid = os.getpid()
        self._shards: dict[str, StoredShard] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._paths: set[str] = set()
        self.pool = BufferPool(pool_bytes)
        # Unlinks what is left when the store is collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, _unlink_all, self._paths, self._pid)

    # ---- put / get / free -------------------------------------------------------------------
    def put(self, key: str, shard: Mapping[str, torch.Tensor]) -> ShardMeta:
        """Copy ``shard`` into the store under ``key`` and return its metadata."""
        with self._lock:
            if key in self._shards:
                raise ShardExists(
                    f"node {self.node_id} already holds shard {key!r}; keys must be unique "
                    f"(free it first or pick another key)"
                )
        slots, size = plan_layout(shard)
        buffer, segment = self._allocate(size)
        if segment is not None:
            if size >= 2 << 20:  # huge tmpfs pages where enabled: consumers map 512x fewer
                madvise(buffer, mmap.MADV_HUGEPAGE)
            madvise(buffer, _MADV_POPULATE_WRITE)  # one syscall instead of a fault per page
        for s in slots:
            if s.nbytes:
                src = shard[s.name].detach().contiguous().reshape(-1).view(torch.uint8)
                dst = torch.frombuffer(buffer, dtype=torch.uint8, count=s.nbytes, offset=s.offset)
                dst.copy_(src)
        meta = ShardMeta(
            key,
            sum(s.nbytes for s in slots),
            count_tokens(shard),
            {s.name: list(s.shape) for s in slots},
            {s.name: s.dtype for s in slots},
        )
        views = tensor_views(buffer, slots)
        self._add(StoredShard(meta, slots, buffer, size, segment, views, segment is None))
        return meta

    def take_buffer(self, size: int) -> mmap.mmap:
        """A private buffer of at least ``size`` bytes (recycled when possible) to pull into."""
        return self.pool.take(size)[0]

    def add_copy(
        self,
        meta: ShardMeta,
        slots: list[TensorSlot],
        buffer: mmap.mmap,
        size: int | None = None,
        *,
        pooled: bool = False,
    ) -> bool:
        """Hold a shard pulled from another node (no copy); False if ``meta.key`` is already held.

        The copy counts in ``stats()`` and is dropped by ``free`` like any shard. ``pooled``:
        ``buffer`` came from ``take_buffer`` and may be recycled once freed.
        """
        size = len(buffer) if size is None else size
        views = tensor_views(buffer, slots)
        entry = StoredShard(meta, slots, buffer, size, None, views, pooled)
        with self._lock:
            if meta.key in self._shards:
                return False
            self._shards[meta.key] = entry
            self._bytes += meta.nbytes
        return True

    def get(self, key: str) -> dict[str, torch.Tensor]:
        """The tensors of shard ``key`` (read-only views; raises ShardNotFound)."""
        return dict(self.entry(key).tensors)

    def entry(self, key: str) -> StoredShard:
        """The stored record of ``key`` (raises ShardNotFound)."""
        with self._lock:
            try:
                return self._shards[key]
            except KeyError:
                raise ShardNotFound(
                    f"shard {key!r} is not held by node {self.node_id} (never stored here, "
                    f"or already freed)"
                ) from None

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._shards

    def free(self, keys: Iterable[str]) -> int:
        """Drop ``keys`` and unlink their segments; returns bytes freed. Unknown keys are no-ops."""
        freed = 0
        for key in keys:
            with self._lock:
                entry = self._shards.pop(key, None)
                if entry is None:
                    continue
                self._bytes -= entry.meta.nbytes
            freed += entry.meta.nbytes
            if entry.segment is not None:
                self._unlink(entry.segment)
            elif entry.pooled:
                buf = entry.buffer
                entry.tensors.clear()
                del entry
                # Each tensor over the buffer (and each record or frame still sending it) holds
                # a reference; with none left but ``buf`` and getrefcount's argument, no one can
                # see what a later pull writes there.
                if sys.getrefcount(buf) == 2:
                    self.pool.give(buf)
                del buf
        return freed

    def stats(self) -> dict[str, int]:
        """Gauges for heartbeats and tests: ``bytes_held``, ``n_shards``, ``bytes_pooled``."""
        with self._lock:
            held = {"bytes_held": self._bytes, "n_shards": len(self._shards)}
        return {**held, "bytes_pooled": self.pool.bytes}

    def keys(self) -> list[str]:
        """Keys currently held."""
        with self._lock:
            return list(self._shards)

    def close(self) -> None:
        """Drop every shard and unlink every segment this store created (idempotent)."""
        with self._lock:
            self._shards.clear()
            self._bytes = 0
        self.pool.clear()
        self._finalizer()

    # ---- internals --------------------------------------------------------------------------
    def _add(self, entry: StoredShard) -> None:
        with self._lock:
            if entry.meta.key in self._shards:
                dup = True
            else:
                dup = False
                self._shards[entry.meta.key] = entry
                self._bytes += entry.meta.nbytes
        if dup:
            if entry.segment is not None:
                self._unlink(entry.segment)
            raise ShardExists(f"node {self.node_id} already holds shard {entry.meta.key!r}")

    def _allocate(self, size: int) -> tuple[mmap.mmap, str | None]:
        if not self.shared_memory:
            return self.take_buffer(size), None
        # The counter is per process: several stores of one run may share a process.
        name = f"arl-{self.run_id}-{self._pid}-{next(_segment_numbers)}"
        path = os.path.join(self.shm_dir, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._paths.add(path)
        try:
            # Reserve the pages now: writing to an unbacked tmpfs page past the limit is SIGBUS.
            os.posix_fallocate(fd, 0, size)
            return mmap.mmap(fd, size), name
        except OSError as e:
            self._unlink(name)
            log.warning(
                "node %s: no room for a %d-byte shard in %s (%s); keeping it in private "
                "memory, same-host pulls of it will go through the socket",
                self.node_id,
                size,
                self.shm_dir,
                e,
            )
            return self.take_buffer(size), None
        finally:
            os.close(fd)

    def _unlink(self, name: str) -> None:
        path = os.path.join(self.shm_dir, name)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self._paths.discard(path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    try:  # a killed but unreaped child is a zombie: its memory is gone, so it counts as dead
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def sweep_orphans(run_id: str, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink this run's segments whose owner process is gone; returns the names removed."""
    prefix = f"arl-{run_id}-"
    removed = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(prefix):
            continue
        parts = name[len(prefix) :].split("-")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            continue  # another run whose id merely starts like ours
        pid = int(parts[0])
        if pid == os.getpid() or _pid_alive(pid):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    if removed:
        log.info("removed %d orphaned shard segments of run %s", len(removed), run_id)
    return removed
