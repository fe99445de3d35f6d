"""Peers refused at the handshake are logged at WARNING with their address (issue 19, item 4).

A real `Controller` (its ROUTER, ZAP thread and refusal watcher) is approached by a peer with a
wrong secret, one with no secret, and a raw TCP client sending bytes that are not ZMTP; a flood
of refusals from one address gives one line per kind, not one per connection.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import zmq

from arl.control.controller import Controller
from arl.wire.sockets import Security, make_socket, new_secret


def _refusals(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith("refused a connection from")]


async def _wait_for(caplog, n: int, timeout: float = 20.0) -> None:
    for _ in range(int(timeout / 0.1)):
        if len(_refusals(caplog)) >= n:
            return
        await asyncio.sleep(0.1)


def test_wrong_secret_no_secret_and_garbage_are_logged_with_their_reasons(caplog):
    caplog.set_level(logging.WARNING, logger="arl.wire")

    async def main() -> str:
        async with Controller(Security(new_secret())) as ctl:
            host, port = "127.0.0.1", int(ctl.address.rsplit(":", 1)[1])
            ctx = zmq.Context()
            try:
                wrong = make_socket(ctx, zmq.DEALER, Security("hunter2"), server=False).socket
                wrong.linger = 0
                wrong.connect(ctl.address)
                wrong.send(b"hello?")
                await _wait_for(caplog, 1)
                bare = ctx.socket(zmq.DEALER)
                bare.linger = 0
                bare.connect(ctl.address)
                bare.send(b"hello?")
                await _wait_for(caplog, 2)
                with socket.create_connection((host, port)) as raw:
                    raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 8)
                    await _wait_for(caplog, 3)
                wrong.close(0)
                bare.close(0)
            finally:
                ctx.term()
            assert not ctl.nodes  # nobody got in
            return ctl.address

    address = asyncio.run(main())
    lines = [r.getMessage() for r in _refusals(caplog)]
    assert all(r.levelno == logging.WARNING for r in _refusals(caplog))
    # The ZAP request names a refused secret's host, so its line keeps it even when libzmq has
    # closed the descriptor before the watcher thread read its port.
    from_wrong = ("refused a connection from 127.0.0.1:", "refused a connection from 127.0.0.1 (")
    assert any(ln.startswith(from_wrong) and "wrong run secret" in ln for ln in lines), lines
    # libzmq names a connection only by its descriptor, read by the watcher thread after the
    # fact: a peer without the secret is refused at once, and on a loaded machine its
    # descriptor can be closed before the watcher reads it; the line then says so.
    from_bare = ("refused a connection from 127.0.0.1:", "refused a connection from an address")
    assert any(ln.startswith(from_bare) and "no run secret" in ln for ln in lines), lines
    assert len(lines) >= 3, lines
    assert all(f"to {address}: " in ln for ln in lines)


def test_a_flood_of_refusals_is_rate_limited(caplog):
    caplog.set_level(logging.WARNING, logger="arl.wire")

    async def main() -> int:
        async with Controller(Security(new_secret())) as ctl:
            ctx = zmq.Context()
            socks = []
            try:
                for _ in range(40):
                    s = make_socket(ctx, zmq.DEALER, Security("hunter2"), server=False).socket
                    s.linger = 0
                    s.connect(ctl.address)
                    socks.append(s)
                for _ in range(50):  # let the handshakes fail
                    await asyncio.sleep(0.1)
                    if ctl.auth._refusals.refused >= 40:
                        break
                return ctl.auth._refusals.refused
            finally:
                for s in socks:
                    s.close(0)
                ctx.term()

    refused = asyncio.run(main())
    lines = [r.getMessage() for r in _refusals(caplog)]
    assert refused >= 40
    assert 1 <= len(lines) <= 3, lines


def test_a_refused_secret_keeps_its_host_when_the_descriptor_closes_first(caplog, monkeypatch):
    """The watcher reads a peer's port from its descriptor after the fact; here it is made to
    read it only after libzmq has refused the secret and closed the connection."""
    import time

    import arl.wire.sockets as sockets

    real = sockets._peer_of

    def late(fd: int) -> tuple[str, str]:
        time.sleep(1.0)
        return real(fd)

    monkeypatch.setattr(sockets, "_peer_of", late)
    caplog.set_level(logging.WARNING, logger="arl.wire")

    async def main() -> None:
        async with Controller(Security(new_secret())) as ctl:
            ctx = zmq.Context()
            try:
                wrong = make_socket(ctx, zmq.DEALER, Security("hunter2"), server=False).socket
                wrong.linger = 0
                wrong.reconnect_ivl = -1  # one connection: its descriptor is not reused
                wrong.connect(ctl.address)
                wrong.send(b"hello?")
                await _wait_for(caplog, 1)
                wrong.close(0)
            finally:
                ctx.term()

    asyncio.run(main())
    lines = [r.getMessage() for r in _refusals(caplog)]
    assert lines and lines[0].startswith(
        "refused a connection from 127.0.0.1 (its port was closed before it could be read) to "
    ), lines
    assert "wrong run secret" in lines[0], lines
