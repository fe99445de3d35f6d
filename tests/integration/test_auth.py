"""Authentication on real sockets (DESIGN §1, issue 8): peers without the run's token are refused
at the ZAP handshake, CURVE mode works end to end, and the secret never leaks.

"Refused at the handshake" is observed from the client's side with a ZMQ socket monitor: the
handshake fails and never succeeds, so libzmq delivers none of the peer's messages. On the
server's side the controller's counters show that not one byte reached arl's code.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import torch
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from arl.control.controller import Controller
from arl.control.launcher import LocalNodes
from arl.protocol.proxy import proxy
from arl.wire.codec import Message, encode_message
from arl.wire.sockets import Security, make_socket, new_secret
from tests.support.cluster import local_cluster
from tests.support.objects import Echo

HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
}


_monitor_ids = itertools.count()


def _monitor(sock: zmq.asyncio.Socket) -> zmq.asyncio.Socket:
    """A PAIR socket receiving ``sock``'s events (a unique inproc address per call: pyzmq's
    get_monitor_socket names it after the socket's fd, which a closed socket frees for reuse)."""
    address = f"inproc://arl-test-monitor-{next(_monitor_ids)}"
    sock.monitor(address, zmq.EVENT_ALL)
    mon = sock.context.socket(zmq.PAIR)
    mon.linger = 0
    mon.connect(address)
    return mon


def _hello(node_id: str) -> list:
    return encode_message(Message("hello", 1, "hello", {"node_id": node_id, "pid": 1}))


def _intruders(ctx: zmq.asyncio.Context, security: Security) -> dict[str, zmq.asyncio.Socket]:
    """Clients that must be refused: no token, a wrong token, another run's token."""
    no_token = ctx.socket(zmq.DEALER)
    no_token.linger = 0
    socks = {
        "no-token": no_token,
        "wrong-token": make_socket(
            ctx, zmq.DEALER, Security("hunter2", security.curve), server=False
        ),
        "other-run": make_socket(
            ctx, zmq.DEALER, Security(new_secret(), security.curve), server=False
        ),
    }
    if security.curve:
        # The right secret, but PLAIN where the server wants CURVE.
        socks["plain-in-curve-mode"] = make_socket(
            ctx, zmq.DEALER, Security(security.secret), server=False
        )
        # The server's real public key, but a client key pair the run did not derive.
        stolen = make_socket(ctx, zmq.DEALER, security, server=False)
        stolen.curve_publickey, stolen.curve_secretkey = zmq.curve_keypair()
        socks["wrong-client-key"] = stolen
    for name, sock in socks.items():
        sock.setsockopt(zmq.ROUTING_ID, name.encode())
    return socks


async def _handshake(mon: zmq.asyncio.Socket, timeout: float = 30.0) -> int:
    """The first handshake outcome a socket monitor reports (succeeded or a failure)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and await mon.poll(left * 1000), "no handshake outcome within the timeout"
        event = (await recv_monitor_message(mon))["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED or event in HANDSHAKE_FAILED:
            return event


async def _assert_refused(socks: dict[str, zmq.asyncio.Socket], address: str) -> None:
    """Each socket connects to ``address``, sends a hello, and is refused at the handshake."""
    monitors = {name: _monitor(sock) for name, sock in socks.items()}
    try:
        for name, sock in socks.items():
            sock.connect(address)
            await sock.send_multipart(_hello(name))
        for name, mon in monitors.items():
            outcome = await _handshake(mon)
            assert outcome in HANDSHAKE_FAILED, f"{name}: handshake {zmq.Event(outcome).name}"
    finally:
        for sock in (*socks.values(), *monitors.values()):
            sock.close(0)


async def _assert_accepted(sock: zmq.asyncio.Socket, address: str) -> None:
    mon = _monitor(sock)
    try:
        sock.connect(address)
        assert await _handshake(mon) == zmq.EVENT_HANDSHAKE_SUCCEEDED
    finally:
        mon.close(0)


def test_controller_refuses_peers_without_the_run_token():
    async def main() -> None:
        security = Security(new_secret())
        async with Controller(security) as ctl:
            ctx = zmq.asyncio.Context()
            try:
                await _assert_refused(_intruders(ctx, security), ctl.address)
                # A peer with the token, on the same controller, is heard: the test can see a
                # hello arrive, and the intruders' hellos did not.
                good = make_socket(ctx, zmq.DEALER, security, server=False)
                good.setsockopt(zmq.ROUTING_ID, b"good")
                hello = _hello("good")
                await _assert_accepted(good, ctl.address)
                await good.send_multipart(hello)
                await ctl.wait_for_nodes(1, timeout=30)
                good.close(0)
                assert sorted(ctl.nodes) == ["good"]
                assert ctl.dropped == 0
                # Every byte arl ever read on this socket is the good peer's hello.
                assert ctl.bytes_in == len(b"good") + sum(len(f) for f in hello)
            finally:
                ctx.destroy(linger=0)

    asyncio.run(main())


def test_node_data_plane_refuses_peers_without_the_run_token():
    async def main() -> None:
        async with local_cluster(1) as (ctl, nodes, procs):
            data_addr = nodes[0].info["data_addr"]
            ctx = zmq.asyncio.Context()
            try:
                await _assert_refused(_intruders(ctx, procs.security), data_addr)
                good = make_socket(ctx, zmq.DEALER, procs.security, server=False)
                await _assert_accepted(good, data_addr)
                good.close(0)
            finally:
                ctx.destroy(linger=0)
            # The node is unharmed and still serves its controller.
            echo = proxy(Echo, await nodes[0].create("tests.support.objects:Echo"))
            assert await echo.echo("still here") == "still here"
            assert not ctl.lost

    asyncio.run(main())


def test_node_with_the_wrong_secret_never_joins(capfd):
    async def main() -> None:
        security = Security(new_secret())
        env = {"OMP_NUM_THREADS": "1", "ARL_LOG_LEVEL": "INFO"}
        kw = {"heartbeat_interval": 0.3, "heartbeat_timeout": 3.0}
        async with Controller(security, **kw) as ctl:
            async with (
                LocalNodes(
                    ctl.address, Security(new_secret()), [env], node_ids=["impostor"], **kw
                ) as bad,
                LocalNodes(ctl.address, security, [env], node_ids=["member"], **kw),
            ):
                await ctl.wait_for_nodes(1, timeout=90)
                # The impostor never hears the controller and gives up by itself: status 1,
                # as a node that never reached its controller.
                assert await asyncio.wait_for(bad.procs[0].wait(), 90) == 1
                assert sorted(ctl.nodes) == ["member"]
                assert ctl.dropped == 0

    asyncio.run(main())
    err = capfd.readouterr().err
    assert "node impostor stopping: controller silent" in err, err[-2000:]


def test_curve_mode_round_trips_tensors_and_refuses_wrong_keys():
    async def main() -> None:
        async with local_cluster(1, curve=True) as (ctl, nodes, procs):
            assert procs.security.curve
            echo = proxy(Echo, await nodes[0].create("tests.support.objects:Echo"))
            payload = {
                "bf16": torch.randn(300, 7).to(torch.bfloat16),
                "ids": torch.arange(10_000, dtype=torch.int64),
                "tiny": torch.tensor([1.5, -2.0]),
                "text": "over an encrypted link",
            }
            back = await echo.echo(payload)
            assert back["text"] == payload["text"]
            for key in ("bf16", "ids", "tiny"):
                assert back[key].dtype == payload[key].dtype
                assert torch.equal(back[key], payload[key]), key
            assert await echo.checksum(payload["ids"]) == float(payload["ids"].sum())

            ctx = zmq.asyncio.Context()
            try:
                await _assert_refused(_intruders(ctx, procs.security), ctl.address)
                await _assert_refused(_intruders(ctx, procs.security), nodes[0].info["data_addr"])
            finally:
                ctx.destroy(linger=0)
            assert [n.node_id for n in ctl.live_nodes()] == [nodes[0].node_id]
            assert ctl.dropped == 0

    asyncio.run(main())


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name} {record.getMessage()}")


def test_secret_never_appears_in_logs_repr_or_process_listings(capfd):
    records = _Records()
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(records)
    root.setLevel(logging.DEBUG)

    async def main() -> tuple[str, list[bytes]]:
        async with local_cluster(2, env={"ARL_LOG_LEVEL": "DEBUG"}) as (ctl, nodes, procs):
            secret = procs.security.secret
            echo = proxy(Echo, await nodes[0].create("tests.support.objects:Echo"))
            await echo.echo(torch.ones(100))
            try:
                await echo.fail("on purpose")
            except Exception as e:  # the remote error and its traceback are logged nowhere secret
                assert secret not in str(e)
            # A peer with the token on a node's data plane: the node's authenticator logs it.
            ctx = zmq.asyncio.Context()
            good = make_socket(ctx, zmq.DEALER, procs.security, server=False)
            await _assert_accepted(good, nodes[1].info["data_addr"])
            good.close(0)
            ctx.destroy(linger=0)
            assert secret not in repr(procs.security) and secret not in str(procs.security)
            assert secret not in repr(ctl.security)
            cmdlines = []
            for pid in procs.pids:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdlines.append(f.read())
            return secret, cmdlines

    try:
        secret, cmdlines = asyncio.run(main())
    finally:
        root.removeHandler(records)
        root.setLevel(old_level)
    node_stderr = capfd.readouterr().err
    controller_log = "\n".join(records.lines)

    # The captures are real: DEBUG lines from the authenticators on both sides are in them.
    assert "zmq.auth ALLOWED (PLAIN)" in controller_log
    assert "zmq.auth ALLOWED (PLAIN)" in node_stderr  # logged at DEBUG only
    assert all(b"-m\0arl.node\0" in c for c in cmdlines)
    assert secret not in controller_log
    assert secret not in node_stderr
    assert not any(secret.encode() in c for c in cmdlines)
