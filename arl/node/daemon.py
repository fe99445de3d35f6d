"""The `arl-node` daemon: one per GPU or CPU slot (DESIGN §1).

It connects a DEALER to the controller's ROUTER and says hello; the controller's reply carries
the run's `NodeConfig` (heartbeats, import prefixes, message cap, data plane), which replaces
the flags' values before the shard store and data plane start and any call is served, so a node
a job script started with default flags honours the run's settings. Then it serves calls:

- ``create``  {name, target: "pkg.module:Attr", args, kwargs, hosted} builds an object by import
  path (only under the allowed module prefixes, checked before anything is imported); ``hosted``
  ({keyword: object name}) hands it objects this node already hosts, and a class that subclasses
  `arl.protocol.hosting.UsesNode` gets the node (a `NodeContext`) as its ``node`` keyword;
- ``call``    {obj, method, args, kwargs} runs a method of such an object: coroutine methods on
  the node's event loop, blocking ones on the node's single engine thread (so torch and NCCL
  calls keep one order);
- ``destroy`` {name} closes and drops an object; ``ping`` answers with the node's info;
- ``free`` {keys} drops shards (owned or pulled copies); ``free_port`` finds a free TCP port
  on this host (for a torch.distributed rendezvous).

It exits on ``bye``, on SIGTERM/SIGINT, and when the controller has been silent for
``heartbeat_timeout`` seconds; once stopped, the process ends within a grace period even where
something in its teardown blocks. Its exit status is 0 when the controller ended it (``bye``),
a signal did, or it stopped itself in order (its engine died, which it told the controller); 1
when it never reached its controller, could not join it (refused, or its data plane did not
start) or lost it, so that a job script or srun sees a node that served no run as a failure; 2,
with one ``error: ...`` line, for bad flags, a missing secret or an address it cannot use.

A watchdog thread notices when the node's event loop has not run for a quarter of
``heartbeat_timeout`` (a blocking call inside ``async def``, e.g. in a reward): it logs the loop
thread's stack and reports the blocking frame to the controller over a socket of its own, so a
run that loses the node names that code instead of a missing heartbeat.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import inspect
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, NoReturn

import zmq

from arl.event_loop import run_loop
from arl.protocol.errors import error_payload
from arl.protocol.hosting import UsesNode
from arl.protocol.imports import ImportRefused as ImportRefused  # re-exported for callers
from arl.protocol.imports import resolve_import
from arl.protocol.node_config import NodeConfig, NodeConfigError
from arl.protocol.stall import stall_report, watchdog_identity
from arl.wire.addresses import free_port, is_loopback
from arl.wire.codec import (
    Message,
    WireError,
    check_message_size,
    decode_message,
    encode_message,
    peek_id,
)
from arl.wire.loop_socket import yield_every
from arl.wire.sockets import (
    Authenticator,
    AuthError,
    Security,
    bind_tcp,
    host_id,
    make_socket,
    new_context,
)

if TYPE_CHECKING:
    from arl.node.data_plane import NodeDataPlane
    from arl.node.shard_store import ShardStore

log = logging.getLogger("arl.node")

DEFAULT_PREFIXES = ("arl.",)


_TICK_S = 0.1
# Each hosted object's close at shutdown waits this long at most.
_CLOSE_TIMEOUT_S = 10.0
# A stopped node's process ends this long (plus the objects' close timeouts) after it stopped,
# whatever blocks its teardown (`NodeDaemon._arm_exit_guard`).
_EXIT_GRACE_S = 10.0
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class NodeStartError(RuntimeError):
    """The node cannot open its sockets with the addresses it was given."""


class NodeDaemon:
    """One node process: serves the controller's calls until told or forced to stop. It is
    the `NodeContext` of the objects it hosts."""

    def __init__(
        self,
        controller: str,
        security: Security,
        *,
        node_id: str,
        config: NodeConfig | None = None,
        data_host: str = "127.0.0.1",
        exit_guard: bool = False,
    ):
        self.controller = controller
        # The process's own daemon (`main`): once stopped, the process ends within a grace
        # period whatever blocks its teardown (`_arm_exit_guard`). Off for a node run in-process.
        self.exit_guard = exit_guard
        self.security = security
        self.node_id = node_id
        self.config = config or NodeConfig()  # the flags' until the hello reply
        self.data_host = data_host
        self.objects: dict[str, Any] = {}
        self.engine_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()
        self._last_heard = time.monotonic()
        self.exit_reason = ""
        # It stopped without serving its run to the end (`stop`); the process then exits 1.
        self.failed = False
        self.run_id = os.environ.get("ARL_RUN_ID", "arl")
        # Started once the hello reply's config is applied (`_configure`), ended with the node.
        self.data_plane: NodeDataPlane | None = None
        self.store: ShardStore | None = None  # the data plane's: this node's shards
        self.configured = False  # the hello reply came and its node config is applied
        self._tick = time.monotonic()
        self._watch_stop = threading.Event()
        self._watchdog: threading.Thread | None = None

    @property
    def allowed_prefixes(self) -> tuple[str, ...]:
        """Module prefixes ``create`` and the node's workflows may import from."""
        return self.config.allowed_import_prefixes

    @property
    def stall_after(self) -> float:
        """Seconds of a silent event loop the watchdog reports (the loop ticks every _TICK_S)."""
        return max(4 * _TICK_S, self.config.heartbeat_timeout / 4)

    # ---- info -------------------------------------------------------------------------------
    def info(self) -> dict:
        """What the node tells the controller about itself."""
        import torch  # imported before the loop by `main`; local for daemons embedded in tests

        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return {
            "node_id": self.node_id,
            "host": socket.gethostname(),
            "host_id": host_id(),
            "data_addr": self.data_addr,
            "device": "cuda" if cuda else "cpu",
            "n_gpus": cuda,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            "pid": os.getpid(),
        }

    def stats(self) -> dict:
        """Gauges sent with every heartbeat (extended by the shard store)."""
        out: dict[str, Any] = {"n_objects": len(self.objects)}
        if self.data_plane is not None:
            out.update(self.data_plane.stats())
        return out

    # ---- main loop --------------------------------------------------------------------------
    async def run(self) -> str:
        """Serve until stopped; returns why the node stopped. Raises `NodeStartError` when its
        sockets cannot bind or connect."""
        self._open_sockets()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.stop, f"signal {sig.name}")
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass
        # What the hello says, taken in a thread before the loop's watchdog starts: its first
        # CUDA query starts NVML, which held a train node's loop for over 2.5 s on an H100 host
        # (the gsm8k recipe, whose gpu_sharing=auto starts MPS there): a stall report with a
        # traceback, refused as coming before any hello. A signal meanwhile is handled, and the
        # node stops once it has the answer.
        info = await loop.run_in_executor(None, self.info)
        self._last_heard = time.monotonic()  # the controller's silence counts from the hello
        recv = asyncio.create_task(self._recv_loop())
        hb = asyncio.create_task(self._heartbeat_loop())
        tick = asyncio.create_task(self._tick_loop())
        self._watchdog = threading.Thread(
            target=self._watch_loop,
            args=(threading.get_ident(),),
            name="arl-loop-watchdog",
            daemon=True,
        )
        self._watchdog.start()
        # A task, not awaited here: refused at the handshake, the node has no link and this send
        # never completes; the heartbeat loop's silence check (and SIGTERM) must still end it.
        hello = asyncio.create_task(self._send(Message("hello", 0, "hello", info)))
        try:
            await self._stop.wait()
        finally:
            # First: with the tick task cancelled below, the watchdog would take the seconds
            # that closing hosted objects and the data plane take for a blocked loop.
            self._stop_watchdog()
            recv.cancel()
            hb.cancel()
            tick.cancel()
            hello.cancel()
            if self.exit_guard:
                self._arm_exit_guard()
            await self._shutdown()
        return self.exit_reason

    def _open_sockets(self) -> None:
        """The control DEALER, connected to the controller, and the data plane's bound ROUTER;
        on failure everything opened so far is closed again and `NodeStartError` raised."""
        self.ctx = new_context()
        self.auth = Authenticator(self.ctx, self.security)
        opened = []
        try:
            # No ZMQ_MAXMSGSIZE on the control DEALER: a frame over it makes libzmq close the
            # link to the controller for good (no reconnect after a protocol error) and the node
            # goes deaf. _recv_loop checks the whole message instead, and answers an oversize
            # call with `err`.
            self.sock = make_socket(self.ctx, zmq.DEALER, self.security, server=False)
            opened.append(self.sock)
            self.sock.setsockopt(zmq.ROUTING_ID, self.node_id.encode())
            self.data_sock = make_socket(
                self.ctx,
                zmq.ROUTER,
                self.security,
                server=True,
                max_message_bytes=self.config.max_message_bytes,
            )
            opened.append(self.data_sock)
            try:
                self.data_addr = bind_tcp(self.data_sock, self.data_host)
            except zmq.ZMQError as e:
                raise NodeStartError(
                    f"cannot bind the data plane on {self.data_host!r} ({e}); pass --data-host "
                    "with an address or name of this machine"
                ) from None
            self.auth.watch(self.data_sock)  # refused peers are logged with their address
            try:
                self.sock.connect(self.controller)
            except zmq.ZMQError as e:
                raise NodeStartError(
                    f"cannot connect to the controller at {self.controller!r} ({e}); pass "
                    "--controller tcp://HOST:PORT as the controller printed it"
                ) from None
        except BaseException:
            self.auth.stop()
            for s in opened:
                s.close(0)
            self.ctx.term()
            raise

    def _stop_watchdog(self) -> None:
        """End the loop watchdog thread (idempotent)."""
        self._watch_stop.set()
        if self._watchdog is not None:
            self._watchdog.join(2.0)  # it closes its socket before the context ends

    def _arm_exit_guard(self) -> None:
        """End the process ``_EXIT_GRACE_S`` (plus each hosted object's close timeout) from now
        if it is still alive: a stopped node must not outlive its run because something in its
        teardown blocks. Seen once: the event loop's close ran a tqdm progress bar's finalizer,
        which waited forever on tqdm's cross-process lock, held by a process killed with the
        test run that started the node."""
        grace = _EXIT_GRACE_S + _CLOSE_TIMEOUT_S * len(self.objects)
        note = (
            f"node {self.node_id}: not exited {grace:.0f} s after it stopped; ending the process\n"
        )

        def force_exit() -> None:
            os.write(2, note.encode())  # not through logging, whose locks may be the ones held
            os._exit(1 if self.failed else 0)

        timer = threading.Timer(grace, force_exit)
        timer.daemon = True
        timer.start()

    async def _configure(self, reply: Any) -> None:
        """Apply the run's node config from the controller's hello reply (none: keep the
        flags'), then start the shard store and data plane, which are built from it."""
        from arl.node.data_plane import NodeDataPlane  # local: torch, after the hello went out

        self.configured = True
        if isinstance(reply, dict) and "node_config" in reply:
            try:
                self.config = NodeConfig.from_wire(reply["node_config"])
            except NodeConfigError as e:
                self.stop(f"the controller's hello reply is unusable: {e}", failed=True)
                return
            log.info("node %s: the run's settings: %s", self.node_id, self.config)
        cfg = self.config
        try:
            # It serves the store on the node's bound data ROUTER and pulls the shards named by
            # RTensor arguments of incoming calls (`_materialize`).
            self.data_plane = NodeDataPlane.start(
                run_id=self.run_id,
                node_id=self.node_id,
                ctx=self.ctx,
                security=self.security,
                socket=self.data_sock,
                shared_memory=cfg.shared_memory,
                chunk_bytes=cfg.pull_chunk_bytes,
                max_message_bytes=cfg.max_message_bytes,
            )
            self.store = self.data_plane.store
        except Exception as e:  # in the receive loop: raised, it would leave the node deaf
            log.exception("node %s: the shard store and data plane did not start", self.node_id)
            self.stop(f"the shard store and data plane did not start: {e}", failed=True)

    def stop(self, reason: str = "stopped", *, failed: bool = False) -> None:
        """Ask the node to stop (idempotent). ``failed``: it ends without serving its run (it
        never reached, could not join or lost its controller): said at ERROR, and the process
        exits 1, where a job script or srun sees it."""
        if not self._stop.is_set():
            self.exit_reason = reason
            self.failed = failed
            level = logging.ERROR if failed else logging.INFO
            log.log(level, "node %s stopping: %s", self.node_id, reason)
            self._stop.set()

    async def _shutdown(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for name, obj in list(self.objects.items()):
            await self._close_object(name, obj)
        self.objects.clear()
        if self.data_plane is not None:
            try:
                await self.data_plane.close()
            except Exception:
                log.exception("closing the data plane failed")
        try:
            await asyncio.wait_for(self._send(Message("bye", 0, "bye", self.exit_reason)), 1.0)
        except Exception:
            pass
        self.engine_thread.shutdown(wait=False, cancel_futures=True)
        self.auth.stop()
        self.sock.close(0)
        self.data_sock.close(0)
        self.ctx.term()

    async def _close_object(self, name: str, obj: Any) -> None:
        close = getattr(obj, "aclose", None) or getattr(obj, "close", None)
        if close is None:
            return
        try:
            if inspect.iscoroutinefunction(close):
                await asyncio.wait_for(close(), _CLOSE_TIMEOUT_S)
            else:
                await asyncio.wait_for(
                    asyncio.get_running_loop().run_in_executor(self.engine_thread, close),
                    _CLOSE_TIMEOUT_S,
                )
        except Exception:
            log.exception("closing object %s failed", name)

    async def _send(self, msg: Message) -> None:
        await self.sock.send_multipart(encode_message(msg), copy=False)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_interval)
            cfg = self.config  # the hello reply may have replaced it meanwhile
            if time.monotonic() - self._last_heard > cfg.heartbeat_timeout:
                silent = f"controller silent for more than {cfg.heartbeat_timeout}s"
                if self.configured:
                    self.stop(f"{silent}: lost the controller at {self.controller}", failed=True)
                else:
                    self.stop(
                        f"{silent}: could not reach the controller at {self.controller}; check "
                        "that it runs there and that this node has the run's secret",
                        failed=True,
                    )
                return
            # Bounded: with no link to the controller (e.g. refused at the handshake, after which
            # libzmq does not reconnect) a send waits forever, and this loop must keep checking.
            try:
                await asyncio.wait_for(
                    self._send(Message("hb", 0, "hb", self.stats())), cfg.heartbeat_interval
                )
            except TimeoutError:
                pass

    # ---- loop watchdog -----------------------------------------------------------------------
    async def _tick_loop(self) -> None:
        while True:
            self._tick = time.monotonic()
            await asyncio.sleep(_TICK_S)

    def _watch_loop(self, loop_thread: int) -> None:
        """Watchdog thread: report each stall of the event loop once, with what blocks it."""
        sock: zmq.Socket | None = None
        reported = False
        try:
            while not self._watch_stop.wait(_TICK_S):
                blocked = time.monotonic() - self._tick
                if blocked < self.stall_after:
                    if reported:
                        log.warning("node %s: event loop running again", self.node_id)
                    reported = False
                    continue
                if reported:
                    continue
                reported = True
                report = stall_report(loop_thread, blocked)
                log.warning(
                    "node %s: event loop blocked for %.1fs in %s\n%s",
                    self.node_id,
                    blocked,
                    report["where"],
                    report["stack"],
                )
                if sock is None:
                    sock = self._watchdog_socket()
                report.update(node_id=self.node_id, pid=os.getpid())
                try:
                    sock.send_multipart(
                        encode_message(Message("event", 0, "loop_stalled", report)), zmq.NOBLOCK
                    )
                except zmq.ZMQError as e:
                    log.warning("node %s: stall report not sent: %s", self.node_id, e)
        finally:
            if sock is not None:
                sock.close(linger=1000)

    def _watchdog_socket(self) -> zmq.Socket:
        """A DEALER of the watchdog's own (the loop's socket is not safe from this thread)."""
        s = make_socket(self.ctx, zmq.DEALER, self.security, server=False).socket
        s.setsockopt(zmq.ROUTING_ID, watchdog_identity(self.node_id))
        s.connect(self.controller)
        return s

    async def _recv_loop(self) -> None:
        handled = 0
        while True:
            handled = await yield_every(handled)  # a backlog is not one turn of the loop
            frames = await self.sock.recv_multipart(copy=False)
            self._last_heard = time.monotonic()
            try:
                check_message_size(frames, self.config.max_message_bytes)
                msg = decode_message(frames)
            except WireError as e:
                log.warning("malformed message from controller dropped: %s", e)
                mid = peek_id(frames)
                if mid is not None:
                    await self._send(Message("err", mid, "", error_payload(e)))
                continue
            if msg.op == "bye":
                self.stop("controller said bye")
                return
            if msg.op == "ok" and msg.method == "hello" and not self.configured:
                # Awaited here, so every call after the reply finds the node configured.
                await self._configure(msg.args)
                continue
            if msg.op == "hb" or msg.op == "ok":
                continue
            if msg.op != "call":
                if msg.op == "err":
                    why = (msg.args or {}).get("message") if isinstance(msg.args, dict) else None
                    self.stop(f"refused by the controller at {self.controller}: {why}", failed=True)
                    return
                await self._send(
                    Message(
                        "err",
                        msg.id,
                        "",
                        error_payload(
                            WireError(f"a node accepts call, hb and bye, not {msg.op!r}")
                        ),
                    )
                )
                continue
            task = asyncio.create_task(self._handle(msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # ---- calls ------------------------------------------------------------------------------
    async def _handle(self, msg: Message) -> None:
        try:
            result = await self.dispatch(msg.method, msg.args if msg.args is not None else {})
            reply = Message("ok", msg.id, msg.method, result)
        except (asyncio.CancelledError, KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as e:  # also torch's CheckpointException (a BaseException, raised
            # on a full disk): an unanswered call would leave the caller waiting forever
            reply = Message("err", msg.id, msg.method, error_payload(e))
        try:
            await self._send(reply)
        except (TypeError, WireError) as e:  # a result that cannot travel
            await self._send(Message("err", msg.id, msg.method, error_payload(e)))

    async def dispatch(self, method: str, a: Any) -> Any:
        """Run one control-plane call and return its (wire-encodable) result."""
        if not isinstance(a, dict):
            raise WireError(f"call args must be a map, got {type(a).__name__}")
        if method == "ping":
            return {**self.info(), **self.stats()}
        if method == "create":
            return await self._create(
                a["name"], a["target"], a.get("args", []), a.get("kwargs", {}), a.get("hosted")
            )
        if method == "call":
            return await self._call(a["obj"], a["method"], a.get("args", []), a.get("kwargs", {}))
        if method == "free":
            # Owners drop their shards and consumers their pulled copies: one fan-out frees all.
            return self.store.free(a["keys"]) if self.store is not None else 0
        if method == "free_port":
            return free_port(a.get("host", self.data_host))
        if method == "destroy":
            obj = self.objects.pop(a["name"], None)
            if obj is not None:
                await self._close_object(a["name"], obj)
            return obj is not None
        raise ValueError(
            f"unknown node method {method!r}; expected ping, create, call, destroy, free, free_port"
        )

    async def _create(
        self, name: str, target: str, args: list, kwargs: dict, hosted: Any = None
    ) -> str:
        if name in self.objects:
            raise ValueError(f"object {name!r} already exists on node {self.node_id}")
        kwargs = {**kwargs, **self._hosted(target, hosted or {})}
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        # Importing (torch, transformers) can take seconds: off the loop, so heartbeats go on.
        resolve_import(target, self.allowed_prefixes, import_now=False)  # refuse before import
        factory = await loop.run_in_executor(
            self.engine_thread, resolve_import, target, self.allowed_prefixes
        )
        t_import = time.perf_counter() - t0
        args, kwargs = await self._materialize(args, kwargs)
        if isinstance(factory, type) and issubclass(factory, UsesNode):
            if "node" in kwargs:
                raise ValueError(f"{target} gets this node as 'node'; do not pass one")
            kwargs["node"] = self  # its store, prefixes and stop (arl.protocol.hosting)
        if inspect.iscoroutinefunction(factory):
            obj = await factory(*args, **kwargs)
        else:
            obj = await loop.run_in_executor(self.engine_thread, lambda: factory(*args, **kwargs))
        self.objects[name] = obj
        log.info(
            "node %s: created %s (%s) in %.1f s (import %.1f s)",
            self.node_id,
            name,
            target,
            time.perf_counter() - t0,
            t_import,
        )
        # Importing torch leaves ~10^5 long-lived objects that every full collection walks,
        # stalling this loop (and its heartbeats and pause calls) for 0.3-0.6 s; keep them out
        # of the collector's way.
        gc.freeze()
        return name

    def _hosted(self, target: str, hosted: Any) -> dict[str, Any]:
        """The objects ``create`` hands to ``target``, by keyword: {keyword: object name}."""
        if not isinstance(hosted, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in hosted.items()
        ):
            raise WireError(f"create's hosted must map keywords to object names, got {hosted!r}")
        missing = sorted(v for v in hosted.values() if v not in self.objects)
        if missing:
            raise KeyError(
                f"{target} needs the object(s) {missing} on node {self.node_id}, which hosts "
                f"{sorted(self.objects)}; create them first"
            )
        return {k: self.objects[v] for k, v in hosted.items()}

    async def _call(self, name: str, method: str, args: list, kwargs: dict) -> Any:
        try:
            obj = self.objects[name]
        except KeyError:
            raise KeyError(
                f"no object {name!r} on node {self.node_id}; known: {sorted(self.objects)}"
            ) from None
        if method.startswith("_"):
            raise PermissionError(f"method {method!r} is private and cannot be called remotely")
        fn = getattr(obj, method)
        args, kwargs = await self._materialize(args, kwargs)
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.engine_thread, lambda: fn(*args, **kwargs))

    async def _materialize(self, args: list, kwargs: dict) -> tuple[list, dict]:
        """Replace RTensor arguments by the shards they name, pulled from their owners."""
        if self.data_plane is None:  # not configured yet: no call is served before that
            return args, kwargs
        return await self.data_plane.materialize(args, kwargs)


class _Parser(argparse.ArgumentParser):
    """argparse, with its error as one ``error: ...`` line (no usage block), as arl's other
    commands print theirs."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _controller_address(text: str) -> str:
    """``--controller``: tcp://HOST:PORT, refused here rather than by libzmq's bare EINVAL."""
    host, _, port = text.removeprefix("tcp://").rpartition(":")
    if not text.startswith("tcp://") or not host or not port.isdigit() or not 0 < int(port) < 2**16:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not tcp://HOST:PORT; pass the address the controller listens on, "
            "e.g. tcp://10.0.0.5:5555"
        )
    return text


def _seconds(text: str) -> float:
    """A heartbeat flag: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def _log_level(text: str) -> str:
    """``--log-level`` (default ``$ARL_LOG_LEVEL``): a `logging` level name, any case."""
    if text.upper() not in _LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"unknown log level {text!r} (from the flag or $ARL_LOG_LEVEL); use one of "
            + ", ".join(_LOG_LEVELS)
        )
    return text.upper()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(prog="arl-node", description=__doc__.split("\n")[0])
    p.add_argument(
        "--controller",
        required=True,
        type=_controller_address,
        help="controller address, tcp://HOST:PORT",
    )
    p.add_argument(
        "--secret-file", default="", help="0600 file with the run secret (default: $ARL_SECRET)"
    )
    p.add_argument(
        "--node-id", default="", help="unique name (default: slurm-<procid> or <host>-<pid>)"
    )
    p.add_argument(
        "--allow-import",
        action="append",
        default=None,
        metavar="PREFIX",
        help="module prefix the node may import engines/workflows from (repeatable; default: "
        "arl.); the controller's hello reply replaces them with cluster.allowed_import_prefixes",
    )
    p.add_argument("--curve", action="store_true", help="use CURVE encryption")
    p.add_argument(
        "--heartbeat-interval",
        type=_seconds,
        default=1.0,
        help="seconds between heartbeats until the controller sends the run's",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=_seconds,
        default=10.0,
        help="seconds of controller silence that end the node, until the controller sends the "
        "run's (so also how long a node waits for a controller that is not up yet)",
    )
    p.add_argument(
        "--data-host",
        default="",
        help="address to bind the data plane on "
        "(default: 127.0.0.1 for a loopback controller, else this host's name)",
    )
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=-1,
        help="largest message accepted (<= 0: no cap); the controller's hello reply replaces it "
        "with the run's transport.max_message_bytes, except for the data plane socket's own "
        "cap, set when it binds",
    )
    p.add_argument(
        "--log-level",
        type=_log_level,  # also applied to the default, so a bad $ARL_LOG_LEVEL is refused too
        default=os.environ.get("ARL_LOG_LEVEL", "WARNING"),
        help=f"one of {', '.join(_LOG_LEVELS)} (default: $ARL_LOG_LEVEL, else WARNING)",
    )
    return p.parse_args(argv)


def default_node_id() -> str:
    """slurm-<procid> under srun, else <host>-<pid>."""
    if "SLURM_PROCID" in os.environ and "SLURM_JOB_ID" in os.environ:
        return f"slurm{os.environ['SLURM_JOB_ID']}-{os.environ['SLURM_PROCID']}"
    return f"{socket.gethostname()}-{os.getpid()}"


def main(argv: list[str] | None = None) -> int:
    """The daemon's command line (``arl-node`` runs it through `arl.node.__main__`); returns
    2 with one ``error:`` line for bad flags, a missing secret or an address it cannot use,
    else ends the process: 1 when the node failed (`NodeDaemon.failed`), 0 otherwise."""
    a = _parse_args(argv)
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(name)s %(message)s")
    try:
        security = Security.from_env(a.secret_file, curve=a.curve)
        config = NodeConfig(
            heartbeat_interval=a.heartbeat_interval,
            heartbeat_timeout=a.heartbeat_timeout,
            allowed_import_prefixes=tuple(a.allow_import or DEFAULT_PREFIXES),
            max_message_bytes=a.max_message_bytes,
        )
    except (AuthError, NodeConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a secret file that exists but cannot be read (a folder, no access)
        print(f"error: --secret-file {a.secret_file}: {e.strerror}", file=sys.stderr)
        return 2
    os.environ.pop("ARL_SECRET", None)  # engines and their subprocesses do not need it
    data_host = a.data_host or ("127.0.0.1" if is_loopback(a.controller) else socket.gethostname())
    node = NodeDaemon(
        a.controller,
        security,
        node_id=a.node_id or default_node_id(),
        config=config,
        data_host=data_host,
        exit_guard=True,
    )
    # The hello reports the node's GPUs (`info`) and every worker runs on torch: imported here,
    # before the event loop, whose watchdog would report a second-long import in it as a stall.
    import torch  # noqa: F401

    try:
        reason = run_loop(node.run())
    except NodeStartError as e:  # nothing runs yet: its sockets are closed again
        print(f"error: {e}", file=sys.stderr)
        return 2
    log.info("node %s exited: %s", node.node_id, reason)
    logging.shutdown()
    # Sockets, shards and hosted objects are closed by now. The engine thread may still be
    # inside a long torch call that cannot be interrupted; the interpreter would wait for it
    # at exit, so leave without joining it.
    os._exit(1 if node.failed else 0)


if __name__ == "__main__":
    sys.exit(main())
