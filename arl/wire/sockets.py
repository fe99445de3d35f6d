"""ZeroMQ sockets with per-run authentication (DESIGN §1: ZAP handshake, optional CURVE).

Every run has a secret token. Server sockets (the controller's ROUTER, each node's data-plane
ROUTER) check it in the ZAP handshake, so a peer without it is refused before any of its bytes
reach arl's code. Without CURVE the token travels as a ZMQ PLAIN password (authentication only,
for trusted networks); with CURVE both key pairs are derived from the token, so the link is
encrypted and the client also verifies the server.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import socket as pysocket
from pathlib import Path

import attrs
import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85

SECRET_ENV = "ARL_SECRET"
_PLAIN_USER = "arl"
_ZAP_DOMAIN = "arl"


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


def write_secret_file(path: str | os.PathLike, secret: str) -> None:
    """Write ``secret`` to ``path`` with mode 0600 (created that way, never world-readable)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)


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
    """ZAP handler for one zmq context: accepts only peers that present the run secret."""

    def __init__(self, ctx: zmq.asyncio.Context, security: Security):
        self.security = security
        # Its own logger would print the secret at DEBUG ("ALLOWED (PLAIN) ... password=...").
        self._auth = AsyncioAuthenticator(
            ctx, log=_HideSecret(logging.getLogger("zmq.auth"), security.secret)
        )
        self._auth.start()
        if security.curve:
            client_public, _ = _curve_pair(security.secret, b"client")
            self._auth.configure_curve_callback(_ZAP_DOMAIN, _CurveAllow(client_public))
        else:
            self._auth.configure_plain(_ZAP_DOMAIN, {_PLAIN_USER: security.secret})

    def stop(self) -> None:
        """Stop the ZAP handler (before the context is terminated)."""
        self._auth.stop()


class _CurveAllow:
    def __init__(self, public: bytes):
        # pyzmq hands the callback the client key z85-encoded (it used to compare the raw key,
        # so every CURVE client was refused; found by tests/integration/test_auth.py). The raw
        # form is accepted as well, for pyzmq versions that pass raw keys.
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
    ctx: zmq.asyncio.Context,
    socket_type: int,
    security: Security,
    *,
    server: bool,
    max_message_bytes: int = -1,
) -> zmq.asyncio.Socket:
    """A socket with the run's credentials: ``server`` sockets authenticate their peers."""
    s = ctx.socket(socket_type)
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
    return s


def bind_tcp(s: zmq.Socket, host: str, port: int = 0) -> str:
    """Bind ``s`` on ``host:port`` (0 picks a free port); returns the connectable address."""
    if port:
        s.bind(f"tcp://{host}:{port}")
        return f"tcp://{host}:{port}"
    bound = s.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{bound}"


def routable_host() -> str:
    """This machine's name as other hosts would reach it (falls back to loopback)."""
    name = pysocket.gethostname()
    try:
        pysocket.getaddrinfo(name, None)
        return name
    except OSError:
        return "127.0.0.1"


def host_id() -> str:
    """Identifies this host (boot): two processes with equal ids can share memory."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{pysocket.gethostname()}/{boot}"
