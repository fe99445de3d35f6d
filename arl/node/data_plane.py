"""The data plane: nodes pull shards from each other, never through the controller (DESIGN §3).

Every node serves its shard store on a bound ROUTER (``DataPlaneServer``) and pulls from other
nodes through one DEALER per owner (``DataPlaneClient``). Messages are arl wire messages:

- ``hello``: the client learns which node and which host it reached (once per connection).
- ``call pull {keys, same_host}``: one ``ok`` carrying, per key, the shard's metadata and tensor
  slots, then ``chunks`` messages ``ok chunk {i, parts}`` whose raw frames are slices of the
  shards' buffers (``parts`` says which shard and offset each frame fills). Shards the client
  can map (same host, kept in shared memory) carry their segment name instead and are not sent.
- an unknown key is answered with ``err`` naming the key and the node.

Chunk frames are zero-copy views of the owner's buffers, so the owner queues a whole reply at
once; TCP back-pressure from the client's receive high-water mark paces it.

Failures raise ``ShardUnavailable`` naming the owner and the key. ZeroMQ hides a peer's death,
so each DEALER's monitor watches its connection: when the owner's kernel closes it (the process
was killed, ran out of memory, or restarted) the pulls waiting on that owner fail at once, after
the replies already received are delivered, and the next pull connects afresh; a pull to an
address where nothing listens any more, or whose handshake is cut short, fails at once as well
(`OwnerLost`). A refused handshake (another run's secret) fails at once as a plain
`ShardUnavailable`. An owner that is silent with its connection open (a host that vanished
without closing TCP, a frozen process) still costs the client's timeout, ``DEFAULT_TIMEOUT``
unless configured.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import mmap
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import zmq
from zmq.utils.monitor import parse_monitor_message

from arl.node.shard_store import (
    ShardNotFound,
    ShardStore,
    StoredShard,
    map_segment,
    sweep_orphans,
)
from arl.protocol.errors import ErrorKind
from arl.protocol.rtensor import RTensor, ShardRef, is_wire_rtensor
from arl.protocol.shards import ShardMeta, TensorSlot
from arl.wire.codec import (
    Message,
    WireError,
    check_message_size,
    decode_message,
    encode_message,
    peek_id,
)
from arl.wire.sockets import (
    HANDSHAKE_FAILED,
    LoopSocket,
    Security,
    SocketClosed,
    host_id,
    make_socket,
)

log = logging.getLogger(__name__)

# Chosen by `python -m arl.bench rtensor --chunk-mib 1 4 16 64`: 1 MiB was fastest on a 2-core
# VM and on a 16-core H200 host (there 1.1-1.2x a raw socket; 4 MiB 0.8-1.0x, 64 MiB 0.4-0.5x).
# libzmq allocates every received message; small chunks reuse malloc'd memory, big ones fault
# in fresh pages, and the client copies one chunk while the next is on the wire.
DEFAULT_CHUNK_BYTES = 1 << 20
# How long a silent owner may keep a pull waiting: one whose connection ends or whose address
# refuses fails at once, so this bounds hosts lost without closing TCP and frozen owners.
DEFAULT_TIMEOUT = 30.0
_RECV_QUEUE = 16  # messages


class ShardUnavailable(RuntimeError):
    """A shard could not be pulled: its owner is gone, silent, or does not hold it.

    Raised at once when the owner closed its connection, refused the handshake or answered
    that it lacks the key; after the client's timeout when the owner is silent or unreachable.
    A gone owner (closed connection, timeout) raises the subclass `OwnerLost`.
    """

    def __init__(self, node: str, key: str, reason: str):
        self.node, self.key, self.reason = node, key, reason
        super().__init__(f"shard {key!r} on node {node!r} is unavailable: {reason}")


class OwnerLost(ShardUnavailable):
    """The owner is gone: it closed its connection (died or restarted), nothing listens at its
    address, or it did not answer within the client's timeout. Unlike a missing key, a fresh
    cluster may get past it."""

    # A pull fails at once when its owner dies, before the controller declares that node lost
    # (heartbeat timeout): the error itself must say the failure is worth a restart.
    error_kind = ErrorKind.PEER_LOST


class _Closed(NamedTuple):
    """What a request learns when its connection is closed: the error to raise, and why."""

    error: type[ShardUnavailable]
    reason: str


def _error(msg_id: int, exc_type: str, message: str, **extra: Any) -> list[Any]:
    body = {"type": exc_type, "message": message, "traceback": "", **extra}
    return encode_message(Message("err", msg_id, "pull", body))


def plan_chunks(sizes: Sequence[int], chunk_bytes: int) -> list[list[list[int]]]:
    """Split buffers of ``sizes`` into messages of about ``chunk_bytes``.

    Each message is a list of parts ``[buffer_index, offset, nbytes]``; small buffers share a
    message, large ones span several.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    chunks: list[list[list[int]]] = []
    cur: list[list[int]] = []
    room = chunk_bytes
    for idx, size in enumerate(sizes):
        off = 0
        while off < size:
            n = min(room, size - off)
            cur.append([idx, off, n])
            off += n
            room -= n
            if room == 0:
                chunks.append(cur)
                cur, room = [], chunk_bytes
    if cur:
        chunks.append(cur)
    return chunks


# ---- server -------------------------------------------------------------------------------------
class DataPlaneServer:
    """Serves one store's shards on a bound ROUTER socket, as an asyncio task it owns."""

    def __init__(
        self,
        store: ShardStore,
        socket: LoopSocket,
        *,
        node_id: str | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_message_bytes: int = -1,
    ):
        self.store = store
        self.socket = socket
        self.node_id = node_id or store.node_id
        self.chunk_bytes = chunk_bytes
        self.max_message_bytes = max_message_bytes  # a whole request's cap (<= 0: none)
        self.host_id = host_id()
        # Chunk frames reference the store's buffers, so queueing a whole reply costs no memory;
        # a finite HWM would make the ROUTER drop chunks silently.
        socket.setsockopt(zmq.SNDHWM, 0)
        self._task: asyncio.Task | None = None

    def start(self) -> asyncio.Task:
        """Start serving on the running loop; ``close()`` ends it."""
        if self._task is None:
            self._task = asyncio.create_task(self._serve(), name=f"data-plane-{self.node_id}")
        return self._task

    async def close(self) -> None:
        """Stop serving (the socket stays open: its creator closes it)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _serve(self) -> None:
        while True:
            frames = await self.socket.recv_multipart(copy=False)
            ident, body = frames[0], frames[1:]
            try:
                check_message_size(body, self.max_message_bytes)
                msg = decode_message(body)
            except WireError as e:
                log.warning("node %s: malformed data-plane request dropped: %s", self.node_id, e)
                mid = peek_id(body)
                if mid is not None:
                    await self._send(ident, _error(mid, "WireError", str(e)))
                continue
            try:
                await self._handle(ident, msg)
            except Exception as e:  # one bad request must not stop the data plane
                log.exception("node %s: data-plane request %s failed", self.node_id, msg.method)
                await self._send(ident, _error(msg.id, type(e).__name__, str(e)))

    async def _send(self, ident: Any, frames: list[Any]) -> None:
        await self.socket.send_multipart([ident, *frames], copy=False)

    async def _handle(self, ident: Any, msg: Message) -> None:
        if msg.op == "hello":
            info = {"node": self.node_id, "host": self.host_id}
            await self._send(ident, encode_message(Message("hello", msg.id, "data", info)))
        elif msg.op == "call" and msg.method == "pull" and isinstance(msg.args, dict):
            await self._pull(ident, msg.id, msg.args.get("keys"), bool(msg.args.get("same_host")))
        else:
            await self._send(
                ident,
                _error(msg.id, "WireError", f"data plane serves hello and call pull, not {msg.op}"),
            )

    async def _pull(self, ident: Any, msg_id: int, keys: Any, same_host: bool) -> None:
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            await self._send(ident, _error(msg_id, "WireError", "pull needs a list of str keys"))
            return
        entries: list[StoredShard] = []
        missing: list[str] = []
        for k in keys:
            try:
                entries.append(self.store.entry(k))
            except ShardNotFound:
                missing.append(k)
        if missing:
            shown = ", ".join(repr(k) for k in missing[:5]) + (" ..." if len(missing) > 5 else "")
            reason = f"node {self.node_id} does not hold shard(s) {shown} (freed, or never stored)"
            err = _error(msg_id, "ShardNotFound", reason, node=self.node_id, keys=missing)
            await self._send(ident, err)
            return
        descs, streamed = [], []
        for e in entries:
            d: dict[str, Any] = {
                "meta": e.meta.to_wire(),
                "slots": [s.to_wire() for s in e.slots],
                "size": e.size,
            }
            if same_host and e.segment is not None:
                d["segment"] = e.segment
            else:
                streamed.append(e)
            descs.append(d)
        chunks = plan_chunks([e.size for e in streamed], self.chunk_bytes)
        head = {"shards": descs, "chunks": len(chunks)}
        await self._send(ident, encode_message(Message("ok", msg_id, "pull", head)))
        views = [memoryview(e.buffer) for e in streamed]
        for i, parts in enumerate(chunks):
            header = encode_message(Message("ok", msg_id, "chunk", {"i": i, "parts": parts}))
            data = [views[b][off : off + n] for b, off, n in parts]
            await self._send(ident, [*header, *data])


# ---- client -------------------------------------------------------------------------------------
class _Peer:
    """One owner node's connection: a DEALER, its reader and monitor tasks, the requests in flight.

    The monitor reports the end of an established connection (the owner's kernel closed TCP),
    a refused connect while a pull waits, and failed handshakes; ``on_lost`` then drops the
    peer, failing what is pending at once.
    """

    def __init__(
        self,
        node: str,
        addr: str,
        sock: LoopSocket,
        ctx: zmq.Context,
        on_lost: Callable[[_Peer, str, type[ShardUnavailable]], None],
    ):
        self.node, self.addr, self.sock = node, addr, sock
        self.host: str | None = None
        self.pending: dict[int, asyncio.Queue] = {}
        self.closed: _Closed | None = None
        self.hello_lock = asyncio.Lock()
        # A unique address: pyzmq's get_monitor_socket names it after a descriptor number,
        # which a closed socket frees for reuse, so a new peer could meet an old one's monitor.
        address = f"inproc://arl-data-peer-{next(_monitor_ids)}-{id(self)}"
        sock.monitor(address, _PEER_EVENTS)
        self.mon = LoopSocket(ctx.socket(zmq.PAIR, socket_class=zmq.Socket))
        self.mon.linger = 0
        self.mon.connect(address)  # before connecting the DEALER: no event is missed
        sock.connect(addr)
        self.reader = asyncio.create_task(self._read(), name=f"data-peer-{node}")
        self.watcher = asyncio.create_task(self._watch(on_lost), name=f"data-peer-mon-{node}")

    async def _read(self) -> None:
        while True:
            self._deliver(await self.sock.recv_multipart(copy=False))

    def _deliver(self, frames: list) -> None:
        try:
            msg = decode_message(frames[:1])
        except WireError as e:
            log.warning("malformed data-plane reply from node %s dropped: %s", self.node, e)
            return
        q = self.pending.get(msg.id)
        if q is not None:  # else: a reply to a request that already gave up
            q.put_nowait((msg, frames[1:]))

    async def _watch(self, on_lost: Callable[[_Peer, str, type[ShardUnavailable]], None]) -> None:
        made = False  # a connection was made (handshake done); one never made is left to timeouts
        lost: str | None = None
        while True:
            event = parse_monitor_message(await self.mon.recv_multipart())
            kind, value = int(event["event"]), int(event["value"])
            if kind == zmq.EVENT_MONITOR_STOPPED:
                return
            if lost is not None:
                # The race: replies come on the DEALER, this event on another socket, so it can
                # be read before the reader task has taken the last replies. libzmq's engine
                # queues all it read for the DEALER before it reports DISCONNECTED, but may make
                # its last batch visible (flush) just after the report; CONNECT_RETRIED, from
                # the reconnect that follows, is reported after that flush. So by now a
                # non-blocking drain finds every whole message the owner sent before it died
                # (libzmq discards a message cut short).
                break
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                made = True
            elif kind == zmq.EVENT_DISCONNECTED and made:
                lost = f"the owner at {self.addr} closed the connection (node dead or restarted?)"
            elif kind == zmq.EVENT_CONNECT_RETRIED and not made and self.pending:
                # Refused: an owner's address comes from its hello, so it was bound before any
                # ref to its shards existed; nothing listening there now means it is gone.
                why = f"nothing listens at {self.addr} any more (node dead or restarted?)"
                on_lost(self, why, OwnerLost)
                return
            elif kind in HANDSHAKE_FAILED:
                # No reply can have come over a connection that never finished its handshake.
                # Without detail it is the connection that failed (reset: the owner died).
                reset = kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                error = OwnerLost if reset else ShardUnavailable
                on_lost(self, _handshake_failure(self.addr, kind, value), error)
                return
        await self._drain()
        on_lost(self, lost, OwnerLost)

    async def _drain(self) -> None:
        """Hand every complete message the DEALER already holds to its request."""
        self.reader.cancel()
        await asyncio.wait([self.reader])  # a receive cancelled after its message keeps it
        while True:
            try:
                frames = await self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._deliver(frames)

    def close(self, reason: str, error: type[ShardUnavailable] = ShardUnavailable) -> None:
        """Fail the pending requests (``error`` with ``reason``); end both tasks, close both
        sockets."""
        if self.closed is not None:
            return
        self.closed = closed = _Closed(error, reason)
        current = asyncio.current_task()
        for task in (self.reader, self.watcher):
            if task is not current:
                task.cancel()
        if not self.sock.socket.closed:  # (a destroyed context closed it already)
            self.sock.disable_monitor()
        self.mon.close(0)
        self.sock.close(0)
        for q in self.pending.values():
            q.put_nowait(closed)
        self.pending.clear()

    async def wait_closed(self) -> None:
        """Wait until both tasks have ended (after ``close``)."""
        tasks = [t for t in (self.reader, self.watcher) if t is not asyncio.current_task()]
        await asyncio.wait(tasks)


_PEER_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_monitor_ids = itertools.count()


def _handshake_failure(addr: str, kind: int, value: int) -> str:
    """Why the handshake with the owner at ``addr`` failed, from its monitor event."""
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"the owner at {addr} refused the handshake (ZAP status {value}): another run's secret?"
        )
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return f"the handshake with {addr} failed (ZMTP error 0x{value:x}): not an arl data plane?"
    return (
        f"the handshake with {addr} failed ({os.strerror(value)}): "
        "node dead, or not an arl data plane?"
    )


class DataPlaneClient:
    """Pulls shards from their owners into the local store; one reused DEALER per owner."""

    def __init__(
        self,
        store: ShardStore,
        *,
        ctx: zmq.Context,
        security: Security,
        node_id: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        force_tcp: bool = False,
    ):
        self.store = store
        self.ctx = ctx
        self.security = security
        self.node_id = node_id or store.node_id
        self.timeout = timeout  # seconds an owner may stay silent before it counts as gone
        self.force_tcp = force_tcp
        self.host_id = host_id()
        self._peers: dict[str, _Peer] = {}
        self._ids = itertools.count(1)

    async def pull(self, batch: RTensor) -> list[dict[str, torch.Tensor]]:
        """The shards of ``batch`` in batch order (pulled where not already held here)."""
        got = await self.pull_shards(batch.refs, batch.peers)
        return [got[r.key] for r in batch.refs]

    async def pull_shards(
        self, refs: Iterable[ShardRef], peers: Mapping[str, str]
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Pull ``refs`` (grouped per owner, owners concurrently) into the store; key -> tensors.

        ``peers`` maps owner node ids to their data-plane addresses. Raises ShardUnavailable
        naming the owner and the key; shards this call added are dropped again on failure.
        """
        by_node: dict[str, list[str]] = {}
        for r in refs:
            if r.key not in self.store and r.key not in by_node.get(r.node, ()):
                by_node.setdefault(r.node, []).append(r.key)
        for node, keys in by_node.items():
            if node == self.node_id:
                raise ShardUnavailable(node, keys[0], "not held by this node (already freed?)")
            if node not in peers:
                raise ShardUnavailable(node, keys[0], "no data-plane address known for this node")
        added: list[str] = []
        try:
            async with asyncio.TaskGroup() as tg:
                for node, keys in by_node.items():
                    tg.create_task(self._pull_from(node, peers[node], keys, added))
        except BaseException as e:
            self.store.free(added)
            if isinstance(e, BaseExceptionGroup):
                for sub in e.exceptions:  # the first owner that failed says what to fix
                    if isinstance(sub, ShardUnavailable):
                        raise sub from None
            raise
        return {r.key: self.store.get(r.key) for r in refs}

    async def close(self) -> None:
        """Close every connection (pending pulls fail with ShardUnavailable)."""
        peers = list(self._peers.values())
        self._peers.clear()
        for peer in peers:
            peer.close(f"connection to {peer.addr} closed: the client was closed")
        for peer in peers:
            await peer.wait_closed()

    # ---- one owner ------------------------------------------------------------------------------
    def _peer(self, node: str, addr: str) -> _Peer:
        peer = self._peers.get(node)
        if peer is not None and peer.addr != addr:
            self._drop(peer, f"connection to {peer.addr} closed: node {node} moved to {addr}")
            peer = None
        if peer is None:
            sock = make_socket(self.ctx, zmq.DEALER, self.security, server=False)
            # Few chunks wait in libzmq: past that, TCP back-pressure paces the owner.
            sock.setsockopt(zmq.RCVHWM, _RECV_QUEUE)
            peer = self._peers[node] = _Peer(node, addr, sock, self.ctx, self._drop)
        return peer

    def _drop(
        self, peer: _Peer, reason: str, error: type[ShardUnavailable] = ShardUnavailable
    ) -> None:
        if self._peers.get(peer.node) is peer:
            del self._peers[peer.node]
        peer.close(reason, error)

    async def _request(self, peer: _Peer, key: str, msg: Message) -> tuple[asyncio.Queue, int]:
        if peer.closed is not None:  # lost while this pull waited for its hello
            raise peer.closed.error(peer.node, key, peer.closed.reason)
        q: asyncio.Queue = asyncio.Queue()
        peer.pending[msg.id] = q
        try:
            await asyncio.wait_for(
                peer.sock.send_multipart(encode_message(msg), copy=False), self.timeout
            )
        except TimeoutError:
            self._drop(peer, f"connection to {peer.addr} closed: a send timed out", OwnerLost)
            raise OwnerLost(
                peer.node, key, f"cannot send to {peer.addr} within {self.timeout}s"
            ) from None
        except SocketClosed:  # lost during the send
            peer.pending.pop(msg.id, None)
            closed = peer.closed or _Closed(ShardUnavailable, "connection closed")
            raise closed.error(peer.node, key, closed.reason) from None
        return q, msg.id

    async def _next(self, peer: _Peer, q: asyncio.Queue, key: str) -> tuple[Message, list]:
        try:
            item = await asyncio.wait_for(q.get(), self.timeout)
        except TimeoutError:
            why = f"connection to {peer.addr} closed: another request timed out"
            self._drop(peer, why, OwnerLost)
            raise OwnerLost(
                peer.node, key, f"no answer from {peer.addr} within {self.timeout}s (node dead?)"
            ) from None
        if isinstance(item, _Closed):
            raise item.error(peer.node, key, item.reason)
        msg, frames = item
        if msg.op == "err":
            a = msg.args if isinstance(msg.args, dict) else {}
            missing = a.get("keys") or [key]
            raise ShardUnavailable(peer.node, missing[0], str(a.get("message", a)))
        return msg, frames

    async def _hello(self, peer: _Peer, key: str) -> None:
        async with peer.hello_lock:
            if peer.host is not None:
                return
            q, mid = await self._request(peer, key, Message("hello", next(self._ids), "data", {}))
            try:
                msg, _ = await self._next(peer, q, key)
            finally:
                peer.pending.pop(mid, None)
            info = msg.args if isinstance(msg.args, dict) else {}
            if info.get("node") != peer.node:
                self._drop(peer, f"connection to {peer.addr} closed: it serves another node")
                raise ShardUnavailable(
                    peer.node, key, f"{peer.addr} is served by node {info.get('node')!r} instead"
                )
            peer.host = str(info.get("host"))

    async def _pull_from(self, node: str, addr: str, keys: list[str], added: list[str]) -> None:
        peer = self._peer(node, addr)
        await self._hello(peer, keys[0])
        same_host = not self.force_tcp and peer.host == self.host_id
        unmapped = await self._pull_request(peer, keys, same_host, added)
        if unmapped:  # segment gone or not ours to open (other namespace): take the bytes
            await self._pull_request(peer, unmapped, False, added)

    async def _pull_request(
        self, peer: _Peer, keys: list[str], same_host: bool, added: list[str]
    ) -> list[str]:
        """One pull; returns the keys whose segments could not be mapped."""
        args = {"keys": keys, "same_host": same_host}
        q, mid = await self._request(peer, keys[0], Message("call", next(self._ids), "pull", args))
        try:
            head, _ = await self._next(peer, q, keys[0])
            try:
                descs = head.args["shards"]
                n_chunks = int(head.args["chunks"])
                metas = [ShardMeta.from_wire(d["meta"]) for d in descs]
                slots = [[TensorSlot.from_wire(s) for s in d["slots"]] for d in descs]
                sizes = [int(d["size"]) for d in descs]
            except (KeyError, TypeError, ValueError) as e:
                raise ShardUnavailable(peer.node, keys[0], f"malformed pull reply: {e}") from None
            unmapped: list[str] = []
            buffers: dict[int, mmap.mmap] = {}
            streamed: list[int] = []
            for i, d in enumerate(descs):
                if "segment" in d:
                    try:
                        buffers[i] = map_segment(d["segment"], sizes[i], self.store.shm_dir)
                    except (FileNotFoundError, PermissionError):
                        unmapped.append(metas[i].key)
                else:
                    streamed.append(i)
                    buffers[i] = self.store.take_buffer(sizes[i])
            targets = [memoryview(buffers[i]) for i in streamed]
            for _ in range(n_chunks):
                msg, frames = await self._next(peer, q, keys[0])
                parts = msg.args.get("parts") if isinstance(msg.args, dict) else None
                if not isinstance(parts, list) or len(parts) != len(frames):
                    raise ShardUnavailable(peer.node, keys[0], "malformed chunk from owner")
                for (b, off, n), frame in zip(parts, frames, strict=True):
                    buf = frame.buffer
                    if not 0 <= b < len(targets) or buf.nbytes != n or off + n > sizes[streamed[b]]:
                        raise ShardUnavailable(peer.node, keys[0], "chunk outside its shard")
                    targets[b][off : off + n] = buf
        finally:
            peer.pending.pop(mid, None)
        for i, buf in buffers.items():
            pooled = "segment" not in descs[i]
            if self.store.add_copy(metas[i], slots[i], buf, sizes[i], pooled=pooled):
                added.append(metas[i].key)
        return unmapped


# ---- a node's data plane, as one service ---------------------------------------------------------
class NodeDataPlane:
    """A node's shard store with its server and client: stats, free, and RTensor arguments."""

    def __init__(self, store: ShardStore, server: DataPlaneServer, client: DataPlaneClient):
        self.store, self.server, self.client = store, server, client

    @classmethod
    def start(
        cls,
        *,
        run_id: str,
        node_id: str,
        ctx: zmq.Context,
        security: Security,
        socket: LoopSocket,
        shared_memory: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_message_bytes: int = -1,
    ) -> NodeDataPlane:
        """Sweep orphaned segments of ``run_id``, then serve the store on the bound ``socket``.

        Without ``shared_memory`` this node neither keeps its shards in shared memory nor maps
        another node's: every pull streams over TCP (``transport.shared_memory``)."""
        sweep_orphans(run_id)
        store = ShardStore(run_id, node_id, shared_memory=shared_memory)
        server = DataPlaneServer(
            store,
            socket,
            node_id=node_id,
            chunk_bytes=chunk_bytes,
            max_message_bytes=max_message_bytes,
        )
        server.start()
        client = DataPlaneClient(
            store, ctx=ctx, security=security, timeout=timeout, force_tcp=not shared_memory
        )
        return cls(store, server, client)

    def stats(self) -> dict[str, int]:
        """The store's gauges (``bytes_held``, ``n_shards``), for heartbeats."""
        return self.store.stats()

    def free(self, keys: list[str]) -> int:
        """Drop ``keys`` (owned or pulled copies); returns bytes freed."""
        return self.store.free(keys)

    async def materialize(self, args: list, kwargs: dict) -> tuple[list, dict]:
        """Replace each RTensor (wire form) in the call arguments by its shards, in batch order."""
        wanted = [a for a in itertools.chain(args, kwargs.values()) if is_wire_rtensor(a)]
        if not wanted:
            return args, kwargs
        pulled = {id(w): await self.client.pull(RTensor.from_wire(w)) for w in wanted}

        def swap(a: Any) -> Any:
            return pulled[id(a)] if is_wire_rtensor(a) else a

        return [swap(a) for a in args], {k: swap(v) for k, v in kwargs.items()}

    async def close(self) -> None:
        """Stop serving, close connections, unlink this node's segments."""
        await self.server.close()
        await self.client.close()
        self.store.close()
