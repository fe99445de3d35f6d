"""A controller with a backlog of calls to one node still serves the others.

Two peers join a real `Controller` over TCP with the run secret, as nodes do. One of them never
reads, so the calls sent to it fill its pipe and then wait in the controller's socket (a rollout
node that fell behind a huge batch). The other must go on receiving heartbeats: before, the
heartbeat loop waited for its heartbeat to the full node, and the train node left after
``heartbeat_timeout`` with "controller silent". Closing the controller then must not wait for
ever on the bye queued behind those calls (it held a stopping launcher until a second signal).
"""

from __future__ import annotations

import asyncio
import time

import zmq

from arl.control import controller as controller_module
from arl.control.controller import Controller
from arl.wire.codec import Message, decode_message, encode_message
from arl.wire.sockets import Security, make_socket, new_secret

PAYLOAD = b"x" * (64 << 10)  # a call's bytes: a few fill the kernel's socket buffers


async def _join(ctx: zmq.Context, ctl: Controller, node_id: str):
    sock = make_socket(ctx, zmq.DEALER, ctl.security, server=False)
    sock.setsockopt(zmq.ROUTING_ID, node_id.encode())
    sock.rcvhwm, sock.rcvbuf = 1, 8192
    sock.connect(ctl.address)
    await sock.send_multipart(encode_message(Message("hello", 1, "hello", {"node_id": node_id})))
    reply = decode_message(await asyncio.wait_for(sock.recv_multipart(copy=False), 30))
    assert reply.op == "ok", reply
    return sock


async def _heartbeats(sock, seconds: float) -> int:
    """Heartbeats ``sock`` receives in ``seconds`` (other messages are read and dropped)."""
    n, deadline = 0, time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if await sock.poll(left * 1000):
            n += decode_message(await sock.recv_multipart(copy=False)).op == "hb"
    return n


def test_a_node_with_a_backlog_of_calls_does_not_hold_back_the_others_heartbeats(monkeypatch):
    def short_queues(*args, **kwargs):
        # Options of a bound socket apply to the connections it accepts from then on: a short
        # pipe and small kernel buffers, so that a few calls fill them.
        sock = make_socket(*args, **kwargs)
        sock.sndhwm, sock.sndbuf = 2, 8192
        return sock

    monkeypatch.setattr(controller_module, "make_socket", short_queues)

    async def main() -> tuple[int, int]:
        ctx = zmq.Context()
        socks, calls = [], []
        try:
            security = Security(new_secret())
            async with Controller(security, heartbeat_interval=0.05, heartbeat_timeout=120) as ctl:
                socks.append(await _join(ctx, ctl, "full"))  # first: its heartbeat goes first
                socks.append(other := await _join(ctx, ctl, "other"))
                calls += [
                    asyncio.create_task(ctl.call("full", "ping", {"pad": PAYLOAD}))
                    for _ in range(200)
                ]
                await asyncio.sleep(0.5)  # the pipe and the kernel's buffers are full by now
                queued = len(ctl.sock._send_queues.get(b"full", ()))
                beats = await _heartbeats(other, 2.0)
            # closed with the calls still queued and "full" still connected, reading nothing
            return queued, beats
        finally:
            await asyncio.gather(*calls, return_exceptions=True)
            for sock in socks:
                sock.close(0)
            ctx.term()

    queued, beats = asyncio.run(asyncio.wait_for(main(), 30))  # the close included
    assert queued > 0  # the backlog this test is about is there
    assert beats >= 5, f"the other node got {beats} heartbeats in 2 s (interval 0.05 s)"
