"""The controller: one ROUTER that every node's DEALER connects to (DESIGN §1).

It is a plain async context manager with no global state, usable inside any running asyncio
loop (several per process are fine)::

    async with Controller(security) as ctl:
        node, = await ctl.wait_for_nodes(1)
        remote = await node.create("arl.node.rollout:RolloutWorker", model_path=model_path)
        worker = proxy(RolloutWorkerAPI, remote)  # arl.protocol.proxy: the API's methods only
        health = await worker.setup()

Calls carry a request id that the reply echoes, so any number can be in flight per node; a
reply is accepted only from the node that was called (others are refused, logged and counted in
``misrouted``).
Heartbeats go both ways; a node silent for ``heartbeat_timeout`` is lost: its in-flight calls
fail with `NodeLost` naming the node and the method, and ``on_node_lost`` callbacks run.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq

from arl.protocol.errors import RemoteError, error_payload
from arl.protocol.node_config import NodeConfig
from arl.protocol.stall import watchdog_identity
from arl.wire.codec import (
    Message,
    WireError,
    check_message_size,
    decode_message,
    encode_message,
    peek_id,
)
from arl.wire.loop_socket import yield_every
from arl.wire.sockets import Authenticator, Security, bind_tcp, make_socket, new_context, new_secret

log = logging.getLogger("arl.controller")
_BYE_WAIT_S = 2.0  # how long `Controller.close` waits for its byes to leave


class NodeLost(RuntimeError):
    """A node stopped answering (or exited) while a call to it was in flight.

    ``blocked_in`` names the code that blocked the node's event loop when its watchdog reported
    one before the heartbeats stopped: a bug that a restart would only repeat.
    """

    def __init__(self, node: str, doing: str = "", why: str = "", blocked_in: str = ""):
        self.node, self.doing, self.blocked_in = node, doing, blocked_in
        what = f" while running {doing}" if doing else ""
        super().__init__(f"node {node} was lost{what}: {why or 'no heartbeat'}")


class BindError(zmq.ZMQError):
    """The controller could not bind its address (the port is taken, or the host is not one of
    this machine's addresses); ``errno`` says which, ``reason`` in words."""

    def __init__(self, host: str, port: int, err: zmq.ZMQError):
        super().__init__(err.errno, f"cannot bind tcp://{host}:{port}: {err.strerror}")
        self.host, self.port, self.reason = host, port, err.strerror


class NodesNotStarted(TimeoutError):
    """Fewer nodes than the run needs said hello: the wait timed out, or a process that was to
    start them ended first. The message says how many came, from where, and what to do. (A
    `TimeoutError`, as the wait's failure always was, so callers catching that still do.)"""


class BadReply(RuntimeError):
    """A node's reply that does not have the shape its call promises (a bug or a hostile peer)."""

    def __init__(self, node: str, method: str, why: str):
        self.node, self.method = node, method
        super().__init__(f"node {node} answered {method} with an unexpected result: {why}")


class NodeHandle:
    """The controller's view of one node: its hello info, gauges, and a way to call it."""

    def __init__(self, ctl: Controller, node_id: str, identity: bytes, info: dict):
        self.ctl, self.node_id, self.identity, self.info = ctl, node_id, identity, info
        self.stats: dict = {}
        self.last_seen = time.monotonic()
        self.lost: str = ""
        self.blocked_in: str = ""  # where its event loop is blocked, from its watchdog
        self._names = itertools.count()

    def __repr__(self) -> str:
        return f"NodeHandle({self.node_id}, pid={self.info.get('pid')})"

    async def call(self, op: str, args: dict | None = None, timeout: float | None = None) -> Any:
        """Run a node-level method (ping, create, call, destroy) and return its result."""
        return await self.ctl.call(self.node_id, op, args or {}, timeout=timeout)

    async def create(
        self,
        target: str,
        *args: Any,
        name: str = "",
        hosted: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> RemoteObject:
        """Build ``target`` ("pkg.module:Class") on the node; returns a handle to the object.
        ``hosted`` ({keyword: object name}) hands it objects the node already hosts."""
        name = name or f"{target.rpartition(':')[2]}-{next(self._names)}"
        call = {"name": name, "target": target, "args": list(args), "kwargs": kwargs}
        if hosted:
            call["hosted"] = dict(hosted)
        await self.call("create", call)
        return RemoteObject(self, name)


class RemoteObject:
    """An object living on a node. Call it through its typed API, ``proxy(API, obj)``
    (`arl.protocol.proxy`), or, where the method is only known at run time, ``await
    obj.call("method", ...)``."""

    def __init__(self, node: NodeHandle, name: str):
        self.node, self.name = node, name

    def __repr__(self) -> str:
        return f"RemoteObject({self.name} on {self.node.node_id})"

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` of the remote object with msgpack-able arguments."""
        return await self.node.call(
            "call", {"obj": self.name, "method": method, "args": list(args), "kwargs": kwargs}
        )

    async def destroy(self) -> bool:
        """Close and drop the object on its node."""
        return await self.node.call("destroy", {"name": self.name})


class Controller:
    """Binds the control-plane ROUTER and tracks nodes, calls and heartbeats."""

    def __init__(
        self,
        security: Security | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 10.0,
        max_message_bytes: int = -1,
        inline_threshold: int = 256,
        node_config: NodeConfig | None = None,
    ):
        self.security = security or Security(new_secret())
        # Sent in every hello reply; the node applies it before any call (none: its flags).
        self.node_config = node_config
        self.host, self.port = host, port
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.max_message_bytes = max_message_bytes
        self.inline_threshold = inline_threshold
        self.nodes: dict[str, NodeHandle] = {}
        self.lost: dict[str, str] = {}
        self.bytes_in = 0
        self.bytes_out = 0
        self.dropped = 0
        self.misrouted = 0  # replies refused because another node sent them (also in dropped)
        self._by_identity: dict[bytes, NodeHandle] = {}
        self._pending: dict[int, tuple[asyncio.Future, str, str]] = {}
        self._ids = itertools.count(1)
        self._node_joined = asyncio.Condition()
        self._lost_handlers: list[Callable[[str, str], Any]] = []
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self.address = ""

    # ---- lifetime ---------------------------------------------------------------------------
    async def __aenter__(self) -> Controller:
        self.ctx = new_context()
        self.auth = Authenticator(self.ctx, self.security)
        self.sock = make_socket(
            self.ctx,
            zmq.ROUTER,
            self.security,
            server=True,
            max_message_bytes=self.max_message_bytes,
        )
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self.address = bind_tcp(self.sock, self.host, self.port)
            self.auth.watch(self.sock)  # refused peers are logged with their address
        except zmq.ZMQError as e:  # e.g. the port is taken: end the ZAP thread and the context
            self.auth.stop()
            self.sock.close(0)
            self.ctx.term()
            raise BindError(self.host, self.port, e) from None
        self._tasks = [
            asyncio.create_task(self._recv_loop(), name="arl-controller-recv"),
            asyncio.create_task(self._heartbeat_loop(), name="arl-controller-hb"),
        ]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Say bye to every node, fail pending calls, close the socket."""
        bye = Message("bye", 0, "bye", "controller closing")
        # To all at once, for a bounded time: a bye waits behind the calls queued to its node,
        # and a node that reads none (its loop blocked) would hold the close for ever. A node
        # that misses its bye leaves when it stops hearing the controller.
        byes = [
            asyncio.create_task(self._send(node.identity, bye))
            for node in self.nodes.values()
            if not node.lost
        ]
        if byes:
            await asyncio.wait(byes, timeout=_BYE_WAIT_S)
            for send in byes:
                send.cancel()
            await asyncio.gather(*byes, return_exceptions=True)
        await asyncio.sleep(0.05)  # let the byes leave before the socket closes
        for t in self._tasks:
            t.cancel()
        for fut, node, method in self._pending.values():
            if not fut.done():
                fut.set_exception(NodeLost(node, method, "controller closed"))
        self._pending.clear()
        self.auth.stop()
        self.sock.close(0)
        self.ctx.term()

    def expect_exits(self) -> None:
        """The run is ending its nodes: from now on a node that leaves is stopped, not lost."""
        self._stopping = True

    # ---- nodes ------------------------------------------------------------------------------
    async def wait_for_nodes(
        self,
        n: int,
        timeout: float = 60.0,
        *,
        stop_if: Callable[[], str | None] | None = None,
        hint: str = "",
    ) -> list[NodeHandle]:
        """Wait until ``n`` nodes said hello; returns them in arrival order.

        `NodesNotStarted` after ``timeout`` seconds, or as soon as ``stop_if()`` returns a
        reason (a launched process exited: no node of it will come); ``hint`` ends its message.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with self._node_joined:
            while len(self.live_nodes()) < n:
                why = stop_if() if stop_if is not None else None
                left = deadline - loop.time()
                if why or left <= 0:
                    raise NodesNotStarted(self._shortfall(n, timeout, why, hint))
                # Polled while a launched process may exit: it says no hello when it does.
                wait_s = min(left, 0.25) if stop_if is not None else left
                try:
                    await asyncio.wait_for(self._node_joined.wait(), wait_s)
                except TimeoutError:
                    pass
        return self.live_nodes()[:n]

    def _shortfall(self, n: int, timeout: float, exited: str | None, hint: str) -> str:
        live = self.live_nodes()
        came = ", ".join(f"{h.node_id} from {h.info.get('host', '?')}" for h in live)
        head = f"{len(live)} of {n} nodes connected to {self.address}" + (
            f" ({came})" if came else ""
        )
        if exited:  # its stderr lines say why; they end the message
            return f"{head} before {exited}"
        hint = hint or "check that the nodes were started with this address and the run secret"
        return f"{head} within {timeout:g}s; {hint}"

    def live_nodes(self) -> list[NodeHandle]:
        """Nodes that said hello and are not lost, in arrival order."""
        return [n for n in self.nodes.values() if not n.lost]

    def on_node_lost(self, handler: Callable[[str, str], Any]) -> None:
        """Call ``handler(node_id, reason)`` when a node is declared lost."""
        self._lost_handlers.append(handler)

    # ---- calls ------------------------------------------------------------------------------
    async def call(self, node_id: str, method: str, args: Any, timeout: float | None = None) -> Any:
        """Send a call to a node and wait for its reply (`RemoteError`, `NodeLost` on failure)."""
        node = self.nodes.get(node_id)
        if node is None:
            raise KeyError(f"unknown node {node_id!r}; known: {sorted(self.nodes)}")
        doing = _describe(method, args)
        if node.lost:
            raise NodeLost(node_id, doing, node.lost, node.blocked_in)
        mid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[mid] = (fut, node_id, doing)
        try:
            await self._send(node.identity, Message("call", mid, method, args), doing)
            if timeout is None:
                return await fut
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._pending.pop(mid, None)

    async def _send(
        self, identity: bytes, msg: Message, doing: str = "", wait: bool = True
    ) -> None:
        """Send ``msg``; a node that is not connected raises `NodeLost` naming ``doing`` (the
        call, as `_describe` names it) or the message's method. With ``wait=False`` a message
        that would wait (behind others to that node, or at its high-water mark) raises
        ``zmq.Again`` and is not sent."""
        frames = encode_message(msg, self.inline_threshold)
        try:
            await self.sock.send_multipart(
                [identity, *frames], flags=0 if wait else zmq.NOBLOCK, copy=False
            )
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                node = self._by_identity.get(identity)
                raise NodeLost(
                    node.node_id if node else identity.decode(errors="replace"),
                    doing or msg.method,
                    "not connected",
                ) from None
            raise
        self.bytes_out += sum(memoryview(f).nbytes for f in frames)

    # ---- receive ----------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        handled = 0
        while True:
            handled = await yield_every(handled)  # a backlog is not one turn of the loop
            frames = await self.sock.recv_multipart(copy=False)
            self.bytes_in += sum(f.buffer.nbytes for f in frames)
            identity, body = frames[0].bytes, frames[1:]
            try:
                check_message_size(body, self.max_message_bytes)  # ZMQ's cap is per frame
                msg = decode_message(body)
            except WireError as e:
                self.dropped += 1
                log.warning("malformed message from %r dropped: %s", identity, e)
                mid = peek_id(body) if body else None
                if mid is not None:
                    await self._reply_err(identity, mid, e)
                continue
            try:
                await self._on_message(identity, msg)
            except Exception as e:  # a handler bug must not take the control plane down
                if isinstance(e, WireError):  # a refused message: no traceback per message
                    log.warning("%s from %r refused: %s", msg.op, identity, e)
                else:
                    log.exception("handling %s from %r failed", msg.op, identity)
                self.dropped += 1
                # A refused hello is answered too, so the node stops instead of waiting.
                if msg.op in ("call", "hello"):
                    await self._reply_err(identity, msg.id, e)

    async def _reply_err(self, identity: bytes, mid: int, e: Exception) -> None:
        try:
            await self._send(identity, Message("err", mid, "", error_payload(e)))
        except Exception:
            pass

    async def _on_message(self, identity: bytes, msg: Message) -> None:
        node = self._by_identity.get(identity)
        if msg.op == "hello":
            await self._on_hello(identity, msg)
            return
        if node is None and msg.op == "event" and msg.method == "loop_stalled":
            self._on_stall_report(identity, msg.args)
            return
        if node is None:  # _recv_loop counts it in dropped
            raise WireError(f"{msg.op!r} from a peer that has not said hello")
        node.last_seen = time.monotonic()
        if msg.op in ("ok", "err"):
            pending = self._pending.get(msg.id)
            if pending is None:
                return  # a reply to a call that timed out or was cancelled
            fut, node_id, method = pending
            if node_id != node.node_id:
                # Call ids are per controller: only the node that was called may answer.
                self.misrouted += 1
                raise WireError(
                    f"{msg.op} for call {msg.id} ({method}) came from node {node.node_id}, "
                    f"but that call went to node {node_id}; refused"
                )
            if fut.done():
                return
            if msg.op == "ok":
                fut.set_result(msg.args)
            else:
                fut.set_exception(RemoteError.from_payload(node_id, method, msg.args))
        elif msg.op == "hb":
            node.blocked_in = ""  # its loop runs again
            if isinstance(msg.args, dict):
                node.stats = msg.args
        elif msg.op == "bye":
            self._declare_lost(node, f"node exited ({msg.args})")
        else:
            raise WireError(f"controller does not accept op {msg.op!r}")

    async def _on_hello(self, identity: bytes, msg: Message) -> None:
        # A malformed hello must not register a node (tests/integration/test_wire_fuzz.py).
        if not isinstance(msg.args, dict) or not isinstance(msg.args.get("node_id", ""), str):
            raise WireError("hello must carry a map whose node_id is a string")
        known = self._by_identity.get(identity)
        if known is not None and not known.lost:
            raise WireError(f"peer {identity!r} already said hello as node {known.node_id!r}")
        info = msg.args
        node_id = str(info.get("node_id") or identity.decode(errors="replace"))
        old = self.nodes.get(node_id)
        if old is not None and not old.lost:
            raise WireError(f"a second node says it is {node_id!r}; node ids must be unique")
        node = NodeHandle(self, node_id, identity, info)
        self.nodes[node_id] = node
        self._by_identity[identity] = node
        reply: dict[str, Any] = {"node_id": node_id}
        if self.node_config is not None:
            reply["node_config"] = self.node_config.to_wire()
        await self._send(identity, Message("ok", msg.id, "hello", reply))
        log.info("node %s joined from %s pid %s", node_id, info.get("host"), info.get("pid"))
        async with self._node_joined:
            self._node_joined.notify_all()

    def _on_stall_report(self, identity: bytes, report: Any) -> None:
        """A node's watchdog says that node's event loop is blocked, and where."""
        node_id = report.get("node_id") if isinstance(report, dict) else None
        node = self.nodes.get(node_id) if isinstance(node_id, str) else None
        if (
            node is None
            or identity != watchdog_identity(node.node_id)
            or report.get("pid") != node.info.get("pid")
        ):
            raise WireError("a stall report must come from the watchdog of a node that said hello")
        node.blocked_in = str(report.get("where", "an unknown place"))
        log.warning(
            "node %s: its event loop has been blocked for %ss in %s; blocking code inside an "
            "async function stops the node (its heartbeats, its other calls)\n%s",
            node.node_id,
            report.get("seconds"),
            node.blocked_in,
            report.get("stack", ""),
        )

    # ---- liveness ---------------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            now = time.monotonic()
            for node in list(self.nodes.values()):
                if node.lost:
                    continue
                if now - node.last_seen > self.heartbeat_timeout:
                    why = f"no heartbeat for {now - node.last_seen:.1f}s"
                    if node.blocked_in:
                        why = (
                            f"its event loop is blocked in {node.blocked_in} ({why}); code "
                            "that blocks inside an async function stops the node: run it in a "
                            "thread (asyncio.to_thread) or make it non-blocking"
                        )
                    self._declare_lost(node, why)
                    continue
                # Never waited for: one node's backlog of calls must not hold back the others'
                # heartbeats (300k calls queued to a rollout node kept the train node's away
                # until it left, "controller silent"); that node hears the calls themselves.
                try:
                    await self._send(node.identity, Message("hb", 0, "hb", None), wait=False)
                except (NodeLost, zmq.Again):
                    pass

    def _declare_lost(self, node: NodeHandle, why: str) -> None:
        if node.lost:
            return
        node.lost = why
        self.lost[node.node_id] = why
        if self._stopping:  # the run itself is ending its nodes
            log.debug("node %s stopped: %s", node.node_id, why)
        else:  # an orderly exit (bye) is news; a silent node is an error
            (log.info if why.startswith("node exited") else log.error)(
                "node %s lost: %s", node.node_id, why
            )
        for fut, node_id, method in list(self._pending.values()):
            if node_id == node.node_id and not fut.done():
                fut.set_exception(NodeLost(node_id, method, why, node.blocked_in))
        for handler in self._lost_handlers:
            handler(node.node_id, why)


def _describe(method: str, args: Any) -> str:
    """A short name for a call, used in NodeLost and RemoteError messages."""
    if method == "call" and isinstance(args, dict):
        return f"{args.get('obj')}.{args.get('method')}"
    if method == "create" and isinstance(args, dict):
        return f"create {args.get('target')}"
    return method
