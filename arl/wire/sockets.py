"""ZeroMQ sockets with per-run authentication (DESIGN §1: ZAP handshake, optional CURVE).

Every run has a secret token. Server sockets (the controller's ROUTER, each node's data-plane
ROUTER) check it in the ZAP handshake, so a peer without it is refused before any of its bytes
reach arl's code. Without CURVE the token travels as a ZMQ PLAIN password (authentication only,
for trusted networks); with CURVE both key pairs are derived from the token, so the link is
encrypted and the client also verifies the server. `Authenticator.watch` logs each refused peer
(wrong or no secret, bytes that are not ZMTP) at WARNING with its address, rate-limited.

`LoopSocket` drives a plain ``zmq.Socket`` from the running asyncio loop (plain or uvloop): it
reads and writes with ``NOBLOCK`` directly and waits on the socket's FD only when an operation
would block, where ``zmq.asyncio`` re-registers readers and spends extra loop rounds per message;
``python -m arl.bench transport`` measures both beside plain sync pyzmq.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import secrets
import socket as pysocket
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import attrs
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from arl.wire.addresses import host_id as host_id  # re-exported: callers import it from here
from arl.wire.addresses import routable_host as routable_host

SECRET_ENV = "ARL_SECRET"
_PLAIN_USER = "arl"
_ZAP_DOMAIN = "arl"

log = logging.getLogger("arl.wire")


class AuthError(RuntimeError):
    """The run secret is missing or unreadable."""


def new_secret() -> str:
    """A fresh random run secret (URL-safe text)."""
    return secrets.token_urlsafe(32)


def read_secret_file(path: str | os.PathLike) -> str:
    """Read a secret from a file that only its owner can read (mode 0600)."""
    p = Path(path)
    try:
        mode = p.stat().st_mode & 0o777
    except FileNotFoundError:
        raise AuthError(f"secret file {p} does not exist; create it with mode 0600") from None
    if mode & 0o077:
        raise AuthError(f"secret file {p} has mode {oct(mode)}; run `chmod 600 {p}`")
    text = p.read_text().strip()
    if not text:
        raise AuthError(f"secret file {p} is empty")
    return text


def _curve_pair(secret: str, role: bytes) -> tuple[bytes, bytes]:
    seed = hashlib.sha256(b"arl-curve-" + role + b"\0" + secret.encode()).digest()
    secret_key = z85.encode(seed)
    return zmq.curve_public(secret_key), secret_key


@attrs.define(repr=False)
class Security:
    """The run's credentials: the shared secret and whether to use CURVE encryption."""

    secret: str
    curve: bool = False

    def __repr__(self) -> str:  # never print the secret
        return f"Security(curve={self.curve}, secret=<hidden>)"

    @classmethod
    def from_env(cls, secret_file: str = "", curve: bool = False) -> Security:
        """Secret from ``secret_file`` when given, else from ``$ARL_SECRET``."""
        if secret_file:
            return cls(read_secret_file(secret_file), curve)
        secret = os.environ.get(SECRET_ENV, "")
        if not secret:
            raise AuthError(f"no run secret: pass --secret-file or set ${SECRET_ENV}")
        return cls(secret, curve)


class Authenticator:
    """ZAP handler for one zmq context: accepts only peers that present the run secret.

    It answers the handshakes on a thread of its own (pyzmq's ThreadAuthenticator), so it works
    beside any event loop; its owner calls ``stop()`` before terminating the context.
    """

    def __init__(self, ctx: zmq.Context, security: Security):
        self.security = security
        # Its own logger would print the secret at DEBUG ("ALLOWED (PLAIN) ... password=...").
        self._auth = ThreadAuthenticator(
            ctx, log=_HideSecret(logging.getLogger("zmq.auth"), security.secret)
        )
        if security.curve:
            client_public, _ = _curve_pair(security.secret, b"client")
            self._auth.configure_curve_callback(_ZAP_DOMAIN, _CurveAllow(client_public))
        else:
            self._auth.configure_plain(_ZAP_DOMAIN, {_PLAIN_USER: security.secret})
        self._auth.start()
        self._refusals = RefusalLog()
        self._watchers: list[_RefusalWatcher] = []

    def watch(self, sock: zmq.Socket | LoopSocket) -> None:
        """Log peers that ``sock`` (a bound server socket) refuses at the handshake: no or wrong
        secret, or bytes that are not ZMTP, at WARNING with their address (rate-limited)."""
        raw = sock.socket if isinstance(sock, LoopSocket) else sock
        watcher = _RefusalWatcher(raw, self._refusals)
        watcher.start()
        self._watchers.append(watcher)

    def stop(self) -> None:
        """Stop the ZAP and watcher threads (before the context is terminated); idempotent."""
        for w in self._watchers:
            w.stop()
        self._watchers.clear()
        self._auth.stop()


class RefusalLog:
    """WARNING lines for refused peers, at most one per (peer host, reason) per ``window``
    seconds and ``burst`` in all per window; a key's next line says how many it left out."""

    def __init__(self, window: float = 10.0, burst: int = 10):
        self.window, self.burst = window, burst
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = {}
        self._window_start = 0.0
        self._in_window = 0
        self.suppressed = 0
        self.refused = 0

    def note(self, key: str, line: str) -> bool:
        """Count one refusal (``key``: its host and kind); log ``line`` unless rate-limited."""
        now = time.monotonic()
        with self._lock:
            self.refused += 1
            if now - self._window_start >= self.window:
                self._window_start, self._in_window = now, 0
                if len(self._last) > 4096:  # a scan from many addresses: forget old ones
                    self._last.clear()
                    self._left_out.clear()
            if now - self._last.get(key, -1e9) < self.window or self._in_window >= self.burst:
                self.suppressed += 1
                self._left_out[key] = self._left_out.get(key, 0) + 1
                return False
            self._last[key] = now
            self._in_window += 1
            left_out = self._left_out.pop(key, 0)
        more = f" ({left_out} more like it not logged)" if left_out else ""
        log.warning("%s%s", line, more)
        return True


_HANDSHAKE_EVENTS = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_NOT_ARL = "no run secret, or not an arl peer"


def _failure(kind: int, value: int) -> str:
    """Why a handshake failed, from its monitor event."""
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"wrong run secret (ZAP status {value})"
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return f"{_NOT_ARL} (ZMTP error 0x{value:x})"
    return f"{_NOT_ARL} ({os.strerror(value)})"


_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
)


_watch_ids = itertools.count()


def _peer_of(fd: int) -> str:
    """``host:port`` of the peer of a connected socket descriptor ("?" if it is gone)."""
    try:
        with pysocket.socket(fileno=os.dup(fd)) as s:
            host, port = s.getpeername()[:2]
    except OSError:
        return "an address already closed"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _RefusalWatcher(threading.Thread):
    """Reads a server socket's monitor events and logs the peers refused at the handshake.

    libzmq names the connection (its descriptor) only in ACCEPTED and DISCONNECTED, not in the
    handshake outcome; an outcome is pinned on a connection when exactly one is waiting for
    its handshake, otherwise the refusal lists every connection that was waiting.
    """

    def __init__(self, sock: zmq.Socket, refusals: RefusalLog):
        super().__init__(name="arl-refusal-watch", daemon=True)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # A unique address: pyzmq's get_monitor_socket names it after a descriptor number,
        # which a closed socket frees for reuse.
        address = f"inproc://arl-refusals-{next(_watch_ids)}-{id(self)}"
        sock.monitor(address, _HANDSHAKE_EVENTS)
        self.mon = sock.context.socket(zmq.PAIR, socket_class=zmq.Socket)
        self.mon.linger = 0
        self.mon.connect(address)
        self.refusals = refusals
        self._stop_event = threading.Event()
        self._waiting: dict[int, str] = {}  # descriptor -> peer, handshake outcome not seen
        self._unpinned = 0  # outcomes seen that could not be pinned on one connection

    def stop(self) -> None:
        self._stop_event.set()
        self.join(2.0)

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                if not self.mon.poll(100):
                    continue
                try:
                    event = parse_monitor_message(self.mon.recv_multipart())
                except (zmq.ZMQError, ValueError):
                    return
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return
                self._on_event(int(event["event"]), int(event["value"]))
        finally:
            self.mon.close(0)

    def _refused(self, peers: list[str], why: str) -> None:
        hosts = {p.rpartition(":")[0] for p in peers}
        host = hosts.pop() if len(hosts) == 1 else "several"
        if len(peers) == 1:
            who = peers[0]
        else:
            more = f" and {len(peers) - 4} more" if len(peers) > 4 else ""
            who = f"one of {', '.join(peers[:4]) or 'unknown'}{more}"
        line = f"refused a connection from {who} to {self.endpoint}: {why}"
        self.refusals.note(f"{host} {why.partition(' (')[0]}", line)

    def _on_event(self, kind: int, value: int) -> None:
        if kind == zmq.EVENT_ACCEPTED:
            self._waiting[value] = _peer_of(value)
            return
        if kind == zmq.EVENT_DISCONNECTED:
            peer = self._waiting.pop(value, None)
            if peer is None:
                return
            if self._unpinned:  # its outcome may be one of those seen
                self._unpinned -= 1
            else:
                self._refused([peer], "closed during the handshake (not an arl peer?)")
            return
        # A handshake outcome.
        peers = list(self._waiting.values())
        if kind in _FAILED:
            self._refused(peers, _failure(kind, value))
        if len(self._waiting) == 1:
            self._waiting.clear()
        else:
            self._unpinned += 1
            if self._unpinned >= len(self._waiting):  # every waiting one has its outcome
                self._waiting.clear()
                self._unpinned = 0


class _CurveAllow:
    def __init__(self, public: bytes):
        # pyzmq hands the callback the client key z85-encoded, so comparing only the raw key
        # would refuse every CURVE client (tests/integration/test_auth.py). The raw form is
        # accepted as well, for pyzmq versions that pass raw keys.
        self.allowed = {public, z85.decode(public)}

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.allowed


class _HideSecret(logging.LoggerAdapter):
    """pyzmq's authenticator logs a PLAIN password at DEBUG; this replaces the run secret."""

    def __init__(self, logger: logging.Logger, secret: str):
        super().__init__(logger, {})
        self._secret = secret

    def log(self, level: int, msg: object, *args: object, **kwargs: object) -> None:
        args = tuple("<hidden>" if self._secret in str(a) else a for a in args)
        super().log(level, msg, *args, **kwargs)  # type: ignore[arg-type]


def make_socket(
    ctx: zmq.Context,
    socket_type: int,
    security: Security,
    *,
    server: bool,
    max_message_bytes: int = -1,
) -> LoopSocket:
    """A `LoopSocket` with the run's credentials: ``server`` sockets authenticate their peers."""
    # A plain socket even from a zmq.asyncio context: LoopSocket does the waiting itself.
    s = ctx.socket(socket_type, socket_class=zmq.Socket)
    s.setsockopt(zmq.LINGER, 0)
    if max_message_bytes > 0:
        s.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if server:
        s.setsockopt(zmq.ZAP_DOMAIN, _ZAP_DOMAIN.encode())
        if security.curve:
            public, secret = _curve_pair(security.secret, b"server")
            s.curve_server = True
            s.curve_secretkey = secret
            s.curve_publickey = public
        else:
            s.plain_server = True
    else:
        if security.curve:
            server_public, _ = _curve_pair(security.secret, b"server")
            public, secret = _curve_pair(security.secret, b"client")
            s.curve_serverkey = server_public
            s.curve_publickey = public
            s.curve_secretkey = secret
        else:
            s.plain_username = _PLAIN_USER.encode()
            s.plain_password = security.secret.encode()
    return LoopSocket(s)


def bind_tcp(s: zmq.Socket | LoopSocket, host: str, port: int = 0) -> str:
    """Bind ``s`` on ``host:port`` (0 picks a free port); returns the connectable address."""
    if port:
        s.bind(f"tcp://{host}:{port}")
        return f"tcp://{host}:{port}"
    bound = s.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{bound}"


# ---- driving a socket from the event loop --------------------------------------------------------

# Plain ints: pyzmq's enum members cost microseconds per operation in `|` and lookups.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
_RCVMORE = int(zmq.RCVMORE)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_EVENTS = int(zmq.EVENTS)
# A send that ZMQ refused although the socket reported POLLOUT (a ROUTER with ROUTER_MANDATORY
# always reports POLLOUT, whichever peer is full) is retried on every FD wake-up and, as a
# backstop, after these delays (doubling), since its peer's wake-up may be consumed unseen.
_RETRY_FIRST_S = 0.001
_RETRY_MAX_S = 0.016


class SocketClosed(zmq.ZMQError):
    """The socket was closed while a send, receive or poll was waiting on it."""

    def __init__(self) -> None:
        super().__init__(zmq.ENOTSOCK, "the socket was closed while this call waited on it")


class _Waiter:
    """One suspended call: its future and, for a send, what to send."""

    __slots__ = ("future", "frames", "copy", "track", "flags")

    def __init__(
        self,
        future: asyncio.Future,
        frames: Any = None,
        copy: bool = True,
        track: bool = False,
        flags: int = 0,  # poll: the events waited for
    ):
        self.future, self.frames, self.copy, self.track = future, frames, copy, track
        self.flags = flags


class LoopSocket:
    """A plain ``zmq.Socket`` driven by the running asyncio loop (plain asyncio or uvloop).

    ``await send_multipart(frames)`` and ``await recv_multipart()`` run the operation with
    NOBLOCK at once and wait on the socket's FD only when it would block (no message, HWM, no
    peer yet). Concurrent callers are served in call order (on a ROUTER, per peer); a cancelled
    receive never loses a message. Options, bind, connect and monitor are the wrapped socket's
    (``s.linger = 0`` sets the option). Use it from one event loop and close it on that loop.
    """

    __slots__ = (
        "socket",
        "_loop",
        "_fd",
        "_router",
        "_recv_waiters",
        "_send_queues",
        "_poll_waiters",
        "_stash",
        "_retry",
        "_retry_delay",
        "_closed",
    )

    def __init__(self, socket: zmq.Socket):
        # A socket class with its own waiting (zmq.asyncio) would hand futures to _serve.
        kind = type(socket)
        if (
            not isinstance(socket, zmq.Socket)
            or kind.send is not zmq.Socket.send
            or kind.recv is not zmq.Socket.recv
        ):
            raise TypeError(
                f"LoopSocket wraps a plain zmq.Socket, got {type(socket).__name__}; create it "
                "with ctx.socket(kind, socket_class=zmq.Socket)"
            )
        self.socket = socket
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1
        self._router = socket.getsockopt(zmq.TYPE) == zmq.ROUTER
        self._recv_waiters: deque[_Waiter] = deque()
        # Sends waiting, in order, per destination: the peer identity on a ROUTER (one full
        # peer must not hold up the others), None on every other kind of socket.
        self._send_queues: dict[bytes | None, deque[_Waiter]] = {}
        self._poll_waiters: list[_Waiter] = []
        self._stash: deque[list] = deque()  # messages handed to receivers that were cancelled
        self._retry: asyncio.TimerHandle | None = None
        self._retry_delay = _RETRY_FIRST_S
        self._closed = False

    def __repr__(self) -> str:
        return f"LoopSocket({self.socket!r})"

    def __getattr__(self, name: str) -> Any:
        if name in LoopSocket.__slots__:  # not set yet
            raise AttributeError(name)
        if name.startswith(("send", "recv")):
            raise AttributeError(
                f"LoopSocket has no {name}(): it would block the event loop; "
                "use `await send_multipart(...)` / `await recv_multipart()`"
            )
        return getattr(self.socket, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in LoopSocket.__slots__:
            object.__setattr__(self, name, value)
        else:  # a zmq option: s.linger = 0, s.curve_publickey = ...
            setattr(self.socket, name, value)

    # ---- the calls ---------------------------------------------------------------------------

    async def recv_multipart(self, flags: int = 0, copy: bool = True) -> list[Any]:
        """The next message: ``zmq.Frame`` objects with ``copy=False`` (no copy), else bytes.

        With ``flags=zmq.NOBLOCK`` raises ``zmq.Again`` instead of waiting.
        """
        if self._closed:
            raise SocketClosed()
        serve = True
        if not self._recv_waiters:
            if self._stash:
                return _as_copy(self._stash.popleft(), copy)
            # Reading EVENTS first is cheaper than a receive that fails (libzmq then checks its
            # commands twice, and pyzmq builds an exception), and most receives find nothing.
            if self.socket.getsockopt(_EVENTS) & _POLLIN:
                frames = self._recv_now(copy)
                if frames is not None:
                    if self._send_queues or self._poll_waiters:
                        self._serve()  # the receive may have taken the wake-up they wait for
                    return frames
            else:  # that read left nothing for this receive; others may wait for its wake-up
                serve = bool(self._send_queues or self._poll_waiters)
            if flags & _NOBLOCK:
                raise zmq.Again()
        elif flags & _NOBLOCK:
            raise zmq.Again()
        waiter = _Waiter(self._attach().create_future(), copy=copy)
        self._recv_waiters.append(waiter)
        if serve:
            self._serve()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            _forget(self._recv_waiters, waiter)
            fut = waiter.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                # Handed a message, then cancelled before it resumed: the next receiver gets it.
                self._stash.append(fut.result())
                self._serve()
            raise

    async def send_multipart(
        self, msg_parts: list[Any], flags: int = 0, copy: bool = True, track: bool = False
    ) -> Any:
        """Send one multipart message (frames may be bytes, buffers or ``zmq.Frame``).

        Waits while ZMQ would block: no peer connected yet, the high-water mark reached, or
        (ROUTER with ROUTER_MANDATORY) that peer's queue full; with ``flags=zmq.NOBLOCK`` raises
        ``zmq.Again`` instead. A ROUTER raises ``zmq.ZMQError(EHOSTUNREACH)`` for an unknown peer
        when ROUTER_MANDATORY is set. A send cancelled before ZMQ took it is not sent.
        """
        if self._closed:
            raise SocketClosed()
        _check_frames(msg_parts)
        queues = self._send_queues
        key = _peer_key(msg_parts) if self._router and queues else None
        if key not in queues:
            try:
                tracker = self._send_now(msg_parts, copy, track)
            except zmq.Again:
                if flags & _NOBLOCK:
                    raise
            else:
                if self._recv_waiters or queues or self._poll_waiters:
                    self._serve()  # the send may have taken the FD wake-up they wait for
                return tracker
            if self._router:
                key = _peer_key(msg_parts)
        elif flags & _NOBLOCK:
            raise zmq.Again()
        waiter = _Waiter(self._attach().create_future(), msg_parts, copy, track)
        queues.setdefault(key, deque()).append(waiter)
        self._serve()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            queue = queues.get(key)
            if queue is not None:
                _forget(queue, waiter)
                if not queue:
                    del queues[key]
            raise

    async def poll(self, timeout: float | None = None, flags: int = _POLLIN) -> int:
        """Wait until the socket can receive (``zmq.POLLIN``) or send (``zmq.POLLOUT``).

        Returns the ready events among ``flags``, or 0 when ``timeout`` milliseconds passed
        first (``None`` or a negative timeout waits for ever), like ``zmq.asyncio``.
        """
        if self._closed:
            raise SocketClosed()
        waiter = _Waiter(self._attach().create_future(), flags=flags)
        self._poll_waiters.append(waiter)
        self._serve()
        try:
            if waiter.future.done() or timeout is None or timeout < 0:
                return await waiter.future
            try:
                async with asyncio.timeout(timeout / 1000):
                    return await waiter.future
            except TimeoutError:
                return 0
        finally:
            _forget(self._poll_waiters, waiter)

    def close(self, linger: int | None = None) -> None:
        """Close the socket; calls waiting on it raise `SocketClosed`. Idempotent."""
        if self._closed:
            return
        self._closed = True
        loop = self._loop
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._fd)  # before the FD is closed and its number reused
            self._fail_all(SocketClosed())
        self._stash.clear()
        self.socket.close(linger)

    # ---- the machinery -----------------------------------------------------------------------

    def _attach(self) -> asyncio.AbstractEventLoop:
        """Watch the socket's FD on the running loop (once); returns the loop."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._fd = self.socket.getsockopt(zmq.FD)
            loop.add_reader(self._fd, self._serve)
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError(
                f"{self!r} is driven by another event loop: a LoopSocket serves the loop that "
                "first waited on it; create one socket per loop"
            )
        return loop

    def _serve(self) -> None:
        """Serve waiting calls while ZMQ can; runs on FD wake-ups and after every operation.

        ZMQ's FD is edge-triggered: any operation (send, receive, reading EVENTS) may consume
        the wake-up of a state that is already there. So while calls wait, this returns only
        after a read of EVENTS that left nothing to do: after that read, any change wakes the
        FD again. (A call that finds nobody waiting reads EVENTS itself before it waits.)
        """
        if self._closed:
            return
        blocked: set[bytes | None] = set()  # refused in this call; the retry timer retries
        try:
            while True:
                events = self.socket.getsockopt(_EVENTS)
                if self._poll_waiters:
                    self._wake_polls(events)
                progress = False
                if (events & _POLLIN or self._stash) and self._recv_waiters:
                    progress = self._recv_one()
                if events & _POLLOUT and self._send_queues:
                    progress = self._send_heads(blocked) or progress
                if not progress:
                    return
                if not (self._recv_waiters or self._send_queues or self._poll_waiters):
                    return  # nobody waits: the next call reads EVENTS itself
        except zmq.ZMQError as e:  # the context was terminated under us
            self._fail_all(e)

    def _recv_one(self) -> bool:
        waiters = self._recv_waiters
        while waiters and waiters[0].future.done():  # cancelled
            waiters.popleft()
        if not waiters:
            return False
        w = waiters[0]
        if self._stash:
            waiters.popleft()
            w.future.set_result(_as_copy(self._stash.popleft(), w.copy))
            return True
        try:
            frames = self._recv_now(w.copy)
        except zmq.ZMQError as e:
            waiters.popleft()
            w.future.set_exception(e)
            return True
        if frames is None:
            return False
        waiters.popleft()
        w.future.set_result(frames)
        return True

    def _recv_now(self, copy: bool) -> list[Any] | None:
        """One whole message if one is there, else None."""
        sock = self.socket
        try:
            first = sock.recv(_NOBLOCK, copy=copy)
        except zmq.Again:
            return None
        frames = [first]
        while sock.getsockopt(_RCVMORE):  # the rest of a message is there with its first frame
            frames.append(sock.recv(_NOBLOCK, copy=copy))
        return frames

    def _send_now(self, msg_parts: list[Any], copy: bool, track: bool) -> Any:
        """Queue one message in libzmq, or raise zmq.Again having queued none of it."""
        # libzmq checks the high-water mark at a message's first frame only.
        send = self.socket.send
        for part in msg_parts[:-1]:
            send(part, _SNDMORE_NOBLOCK, copy=copy, track=track)
        return send(msg_parts[-1], _NOBLOCK, copy=copy, track=track)

    def _send_heads(self, blocked: set[bytes | None]) -> bool:
        """Send queued messages, in order per destination, until ZMQ refuses one."""
        progress = False
        for key, queue in list(self._send_queues.items()):
            if key in blocked:
                continue
            while queue:
                w = queue[0]
                if w.future.done():  # cancelled
                    queue.popleft()
                    continue
                try:
                    result = self._send_now(w.frames, w.copy, w.track)
                except zmq.Again:
                    # An operation ran, so EVENTS is read again; this destination waits for an
                    # FD wake-up or the retry timer.
                    blocked.add(key)
                    self._arm_retry()
                    progress = True
                    break
                except zmq.ZMQError as e:  # EHOSTUNREACH: that peer is gone
                    queue.popleft()
                    w.future.set_exception(e)
                else:
                    queue.popleft()
                    w.future.set_result(result)
                    self._retry_delay = _RETRY_FIRST_S
                progress = True
            if not queue:
                del self._send_queues[key]
        return progress

    def _wake_polls(self, events: int) -> None:
        if self._stash:
            events |= _POLLIN
        for w in self._poll_waiters:
            ready = events & w.flags
            if ready and not w.future.done():
                w.future.set_result(ready)

    def _arm_retry(self) -> None:
        if self._retry is None and self._loop is not None:
            self._retry = self._loop.call_later(self._retry_delay, self._on_retry)
            self._retry_delay = min(self._retry_delay * 2, _RETRY_MAX_S)

    def _on_retry(self) -> None:
        self._retry = None
        self._serve()

    def _fail_all(self, exc: BaseException) -> None:
        waiters = [*self._recv_waiters, *self._poll_waiters]
        for queue in self._send_queues.values():
            waiters += queue
        self._recv_waiters.clear()
        self._send_queues.clear()
        self._poll_waiters.clear()
        for w in waiters:
            if not w.future.done():
                w.future.set_exception(exc)


def _check_frames(msg_parts: list[Any]) -> None:
    """Refuse a message that could not be sent whole (before any frame of it is queued)."""
    if not msg_parts:
        raise ValueError("a message needs at least one frame")
    for i, part in enumerate(msg_parts):
        if not isinstance(part, (bytes, zmq.Frame, memoryview)):
            try:
                memoryview(part)
            except TypeError:
                raise TypeError(
                    f"frame {i} of the message ({type(part).__name__}) is not bytes or a buffer"
                ) from None


def _peer_key(msg_parts: list[Any]) -> bytes:
    """A ROUTER message's destination: its first frame, as bytes."""
    ident = msg_parts[0]
    return ident if isinstance(ident, bytes) else bytes(ident)


def _as_copy(frames: list[Any], copy: bool) -> list[Any]:
    """A stashed message in the form its new receiver asked for (bytes, or zmq.Frame)."""
    if copy:
        return [f if isinstance(f, bytes) else f.bytes for f in frames]
    return [zmq.Frame(f) if isinstance(f, bytes) else f for f in frames]


def _forget(waiters: Any, waiter: _Waiter) -> None:
    try:
        waiters.remove(waiter)
    except ValueError:
        pass
