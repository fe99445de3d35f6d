"""ZeroMQ sockets with per-run authentication (DESIGN §1: ZAP handshake, optional CURVE).

Every run has a secret token. Server sockets (the controller's ROUTER, each node's data-plane
ROUTER) check it in the ZAP handshake, so a peer without it is refused before any of its bytes
reach arl's code. Without CURVE the token travels as a ZMQ PLAIN password (authentication only,
for trusted networks); with CURVE both key pairs are derived from the token, so the link is
encrypted and the client also verifies the server. `Authenticator.watch` logs each refused peer
(wrong or no secret, bytes that are not ZMTP) at WARNING with its address, rate-limited.
`make_socket` returns its sockets as `arl.wire.loop_socket.LoopSocket` (re-exported here, with
`SocketClosed`), driven from the running asyncio loop.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import os
import resource
import secrets
import socket as pysocket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from arl.wire.addresses import host_id as host_id  # re-exported: callers import it from here
from arl.wire.addresses import routable_host as routable_host
from arl.wire.loop_socket import LoopSocket as LoopSocket
from arl.wire.loop_socket import SocketClosed as SocketClosed

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
    """Read a secret from a file that only its owner can read (mode 0600); ``~`` is the home
    folder (a shell leaves it in ``transport.secret_file=~/s`` and ``--secret-file=~/s``)."""
    p = Path(path).expanduser()
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
        self._auth = _Zap(ctx, log=_HideSecret(logging.getLogger("zmq.auth"), security.secret))
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
        watcher = _RefusalWatcher(raw, self._refusals, self._auth.denied)
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

    def __init__(
        self, window: float = 10.0, burst: int = 10, clock: Callable[[], float] = time.monotonic
    ):
        self.window, self.burst, self._clock = window, burst, clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = {}
        self._window_start = 0.0
        self._in_window = 0
        self.suppressed = 0
        self.refused = 0

    def note(self, key: str, line: str) -> bool:
        """Count one refusal (``key``: its host and kind); log ``line`` unless rate-limited."""
        now = self._clock()
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


HANDSHAKE_FAILED = (  # the monitor events of a failed handshake
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
)


_watch_ids = itertools.count()
_GONE = "an address already closed"


def _peer_of(fd: int) -> tuple[str, str]:
    """(host, ``host:port``) of the peer of a connected socket descriptor; ("", `_GONE`) if
    the descriptor is closed already."""
    try:
        with pysocket.socket(fileno=os.dup(fd)) as s:
            host, port = s.getpeername()[:2]
    except OSError:
        return "", _GONE
    return host, (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")


class _Zap(ThreadAuthenticator):
    """pyzmq's ZAP thread, which also keeps the address of each peer it refused, oldest first.

    The refusal watcher learns a peer's address from its descriptor, which libzmq may close
    before the watcher thread reads it; a refused secret's ZAP request names the peer's host,
    so that refusal keeps its host even then.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.denied: collections.deque[str] = collections.deque(maxlen=256)
        self._asking = ""

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self._asking = msg[3].decode("utf-8", "replace") if len(msg) > 3 else ""
        await super().handle_zap_message(msg)

    def _send_zap_reply(self, request_id, status_code, status_text, user_id="anonymous"):
        if status_code != b"200":
            self.denied.append(self._asking)
        super()._send_zap_reply(request_id, status_code, status_text, user_id)


class _RefusalWatcher(threading.Thread):
    """Reads a server socket's monitor events and logs the peers refused at the handshake.

    libzmq names the connection (its descriptor) only in ACCEPTED and DISCONNECTED, not in the
    handshake outcome; an outcome is pinned on a connection when exactly one is waiting for
    its handshake, otherwise the refusal lists every connection that was waiting.
    """

    def __init__(self, sock: zmq.Socket, refusals: RefusalLog, denied: collections.deque[str]):
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
        self._denied = denied  # hosts the ZAP handler refused, one per failed-auth event
        self._stop_event = threading.Event()
        self._waiting: dict[int, tuple[str, str]] = {}  # descriptor -> peer, outcome not seen
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

    def _refused(self, peers: list[tuple[str, str]], why: str) -> None:
        hosts = {host for host, _ in peers}
        host = hosts.pop() if len(hosts) == 1 else "several"
        if len(peers) == 1:
            who = peers[0][1]
        else:
            more = f" and {len(peers) - 4} more" if len(peers) > 4 else ""
            who = f"one of {', '.join(p for _, p in peers[:4]) or 'unknown'}{more}"
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
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            # One denial per failed-auth event, in order; more than one waiting means they fell
            # out of step (events dropped in a flood): trust none, and start again in step.
            asked = self._denied.popleft() if len(self._denied) == 1 else ""
            self._denied.clear()
            if asked and len(peers) == 1 and peers[0][1] == _GONE:
                peers = [(asked, f"{asked} (its port was closed before it could be read)")]
        if kind in HANDSHAKE_FAILED:
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


_WANT_OPEN_FILES = 65536


def new_context() -> zmq.Context:
    """A zmq context sized for many peers.

    A node keeps one DEALER and its monitor's two PAIRs per shard owner it pulls from, and the
    controller one connection per node, so libzmq's default cap of 1,023 sockets and a common
    soft limit of 1,024 open files would stop a run at a few hundred peers. The process's soft
    limit is raised towards its hard limit (as inference servers do), and the context may use
    half of it for sockets (the other half: connections, files, the model).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = _WANT_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, _WANT_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:  # a container may refuse; the defaults still work
            log.debug("could not raise the open-file limit from %d to %d: %s", soft, want, exc)
    ctx = zmq.Context()
    limit = ctx.get(zmq.SOCKET_LIMIT)
    files = limit * 2 if soft == resource.RLIM_INFINITY else soft
    ctx.set(zmq.MAX_SOCKETS, max(ctx.get(zmq.MAX_SOCKETS), min(limit, files // 2)))
    return ctx


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
