"""`LoopSocket`, arl's event-loop adapter for ZeroMQ sockets, on real sockets in one process.

Every test runs on plain asyncio and on uvloop (what nodes and the launcher use). Back-pressure
tests use inproc transports, whose high-water marks are exact (no kernel buffers in between).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch
import uvloop
import zmq
import zmq.asyncio

from arl.wire.loop_socket import _SERVE_BUDGET, RECV_BURST, yield_every
from arl.wire.sockets import LoopSocket, SocketClosed

_inproc = itertools.count()


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request) -> Callable[[Coroutine[Any, Any, Any]], Any]:
    """Runs a test's coroutine on the loop kind; a lost wake-up fails it instead of hanging."""
    runner = asyncio.run if request.param == "asyncio" else uvloop.run
    return lambda coro: runner(asyncio.wait_for(coro, 60))


@pytest.fixture
def ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _pair(
    ctx: zmq.Context, kind: int = zmq.DEALER, *, tcp: bool = False, **opts: int
) -> tuple[LoopSocket, LoopSocket]:
    """A ROUTER and a connected ``kind`` socket; ``opts`` like router_sndhwm=1, peer_rcvhwm=1."""
    router, peer = LoopSocket(ctx.socket(zmq.ROUTER)), LoopSocket(ctx.socket(kind))
    for name, value in opts.items():
        side, opt = name.split("_", 1)
        setattr(router if side == "router" else peer, opt, value)
    router.linger = peer.linger = 0
    if tcp:
        address = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    else:
        address = f"inproc://loop-socket-{next(_inproc)}"
        router.bind(address)
    peer.routing_id = b"peer"
    peer.connect(address)
    return router, peer


async def _settle(n: int = 20) -> None:
    """Let the loop run a few rounds (callbacks, FD wake-ups) without waiting on time."""
    for _ in range(n):
        await asyncio.sleep(0)


def test_messages_arrive_whole_and_in_order_both_ways(run, ctx):
    async def main() -> None:
        router, dealer = _pair(ctx, tcp=True)
        n = 2000

        async def send() -> None:
            for i in range(n):
                await dealer.send_multipart([b"seq", str(i).encode(), b"x" * (i % 300)])

        sender = asyncio.create_task(send())
        for i in range(n):
            ident, *frames = await router.recv_multipart()
            assert ident == b"peer" and frames == [b"seq", str(i).encode(), b"x" * (i % 300)]
            await router.send_multipart([ident, b"ack", str(i).encode()], copy=False)
        await sender
        for i in range(n):
            frames = await dealer.recv_multipart(copy=False)
            assert all(isinstance(f, zmq.Frame) for f in frames)  # not copied into bytes
            assert [f.bytes for f in frames] == [b"ack", str(i).encode()]
        router.close()
        dealer.close()

    run(main())


def test_concurrent_receivers_are_served_in_call_order(run, ctx):
    async def main() -> None:
        router, dealer = _pair(ctx, tcp=True)
        receivers = [asyncio.create_task(router.recv_multipart()) for _ in range(20)]
        await _settle()
        assert not any(r.done() for r in receivers)  # nothing sent yet: all wait
        for i in range(20):
            await dealer.send_multipart([str(i).encode()])
        got = await asyncio.gather(*receivers)
        assert [frames[1] for frames in got] == [str(i).encode() for i in range(20)]
        router.close()
        dealer.close()

    run(main())


def test_many_senders_and_receivers_lose_and_reorder_nothing(run, ctx):
    async def main() -> None:
        router, dealer = _pair(ctx, tcp=True, peer_sndhwm=8, router_rcvhwm=8)
        senders, per_sender, n_receivers = 8, 300, 4
        received: list[tuple[int, int, int]] = []
        tickets = itertools.count()  # the order of the receive calls

        async def send(s: int) -> None:
            for i in range(per_sender):
                await dealer.send_multipart([bytes([s]), i.to_bytes(4, "big")])
                if i % 7 == s:
                    await asyncio.sleep(0)

        async def receive(stop: asyncio.Event) -> None:
            while not stop.is_set():
                ticket = next(tickets)
                _, s, i = await router.recv_multipart()
                received.append((ticket, s[0], int.from_bytes(i, "big")))
                if len(received) == senders * per_sender:
                    stop.set()

        stop = asyncio.Event()
        receivers = [asyncio.create_task(receive(stop)) for _ in range(n_receivers)]
        await asyncio.gather(*(send(s) for s in range(senders)))
        await stop.wait()
        for r in receivers:
            r.cancel()
        assert len(received) == senders * per_sender
        received.sort()  # the i-th receive call got the i-th message:
        for s in range(senders):  # each sender's messages arrived once each, in its order
            assert [i for _, who, i in received if who == s] == list(range(per_sender))
        router.close()
        dealer.close()

    run(main())


def test_a_cancelled_receive_loses_no_message(run, ctx):
    """Cancel receivers at every point around a message's arrival: each message is received
    exactly once, in order (a message already handed to a cancelled receiver goes to the next)."""

    async def main() -> None:
        router, dealer = _pair(ctx)
        got: list[bytes] = []
        sent = 0
        for rounds in range(12):  # how long the receiver waits before the message is sent
            for delay in range(12):  # how many loop rounds pass before the cancel
                task = asyncio.create_task(router.recv_multipart())
                await _settle(rounds)
                await dealer.send_multipart([str(sent).encode()])
                sent += 1
                await _settle(delay)
                task.cancel()
                try:
                    got.append((await task)[1])
                except asyncio.CancelledError:
                    pass
                # What the cancelled receiver did not take is still there, and nothing else:
                while await router.poll(0):
                    got.append((await router.recv_multipart())[1])
                assert got == [str(i).encode() for i in range(sent)]
        router.close()
        dealer.close()

    run(main())


def test_a_send_does_not_swallow_the_wake_up_of_a_waiting_receive(run, ctx):
    """ZMQ's FD is edge-triggered: a send that processes the socket's pending commands takes the
    wake-up of a message that arrived meanwhile; the waiting receive must get it anyway."""

    async def main() -> None:
        for _ in range(5):
            router, dealer = _pair(ctx)
            await router.send_multipart([b"peer", b"warm-up"])
            assert (await dealer.recv_multipart()) == [b"warm-up"]  # the pipe exists
            waiting = asyncio.create_task(dealer.recv_multipart())
            await _settle()
            await router.send_multipart([b"peer", b"reply"])  # wakes the dealer's FD...
            # ...and the dealer's first send processes its commands (libzmq throttles that to
            # once a millisecond or so; a first send always does), consuming the wake-up.
            await dealer.send_multipart([b"request"])
            assert await asyncio.wait_for(waiting, 10) == [b"reply"]
            assert (await router.recv_multipart())[1] == b"request"
            router.close()
            dealer.close()

    run(main())


def test_receive_timeouts_under_a_stream_lose_no_message(run, ctx):
    async def main() -> None:
        router, dealer = _pair(ctx, tcp=True)
        n = 400

        async def send() -> None:
            for i in range(n):
                await dealer.send_multipart([i.to_bytes(4, "big")])
                if i % 3 == 0:
                    await asyncio.sleep(0.0005)

        sender = asyncio.create_task(send())
        got = []
        while len(got) < n:
            try:
                frames = await asyncio.wait_for(router.recv_multipart(copy=False), 0.0003)
            except TimeoutError:
                continue
            got.append(int.from_bytes(frames[1].bytes, "big"))
        await sender
        assert got == list(range(n))
        router.close()
        dealer.close()

    run(main())


def test_large_zero_copy_frames_arrive_intact(run, ctx):
    async def main() -> None:
        router, dealer = _pair(ctx, tcp=True)
        tensors = [
            torch.arange(n, dtype=torch.int32) * k for n, k in [(16 << 20, 3), (1, 5), (3 << 20, 7)]
        ]
        tracker = await dealer.send_multipart(
            [b"head", *(memoryview(t.numpy()) for t in tensors)], copy=False, track=True
        )
        ident, head, *frames = await router.recv_multipart(copy=False)
        assert head.bytes == b"head" and len(frames) == len(tensors)
        for frame, t in zip(frames, tensors, strict=True):
            assert isinstance(frame, zmq.Frame)
            got = torch.frombuffer(frame.buffer, dtype=torch.int32)  # a view of the frame
            assert torch.equal(got, t)
        await asyncio.wait_for(asyncio.to_thread(tracker.wait), 30)  # libzmq let go of them
        router.close()
        dealer.close()

    run(main())


def test_send_waits_at_the_high_water_mark_and_keeps_call_order(run, ctx):
    async def main() -> None:
        router, dealer = _pair(ctx, peer_sndhwm=2, router_rcvhwm=2)
        queued = 0
        while True:  # fill the pipe until ZMQ refuses
            try:
                await dealer.send_multipart([str(queued).encode()], flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            queued += 1
            assert queued < 100, "the high-water mark never applied"
        first = asyncio.create_task(dealer.send_multipart([b"first"]))
        await _settle()
        second = asyncio.create_task(dealer.send_multipart([b"second"]))
        cancelled = asyncio.create_task(dealer.send_multipart([b"never"]))
        third = asyncio.create_task(dealer.send_multipart([b"third"]))
        await _settle()
        assert not (first.done() or second.done() or third.done())  # nobody reads: they wait
        with pytest.raises(zmq.Again):  # others wait: a NOBLOCK send does not jump the queue
            await dealer.send_multipart([b"jump"], flags=zmq.NOBLOCK)
        cancelled.cancel()
        got = [(await router.recv_multipart())[1] for _ in range(queued + 3)]
        await asyncio.gather(first, second, third)
        assert got == [str(i).encode() for i in range(queued)] + [b"first", b"second", b"third"]
        assert await router.poll(50) == 0  # the cancelled send was never sent
        router.close()
        dealer.close()

    run(main())


def test_cancelled_sends_anywhere_in_the_queue_are_never_sent_and_the_rest_keep_order(run, ctx):
    """Sends cancelled at the head, the tail and in the middle of a queue behind a full pipe (a
    run stopped with its requests in flight) are dropped; the others go in call order."""

    async def main() -> None:
        router, dealer = _pair(ctx, peer_sndhwm=2, router_rcvhwm=2)
        queued = 0
        while True:  # fill the pipe until ZMQ refuses
            try:
                await dealer.send_multipart([b"fill"], flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            queued += 1
        sends = [asyncio.create_task(dealer.send_multipart([b"%d" % i])) for i in range(200)]
        await _settle()
        dropped = {0, 199, *range(50, 150)}  # the head, the tail, a block in the middle
        for i in sorted(dropped, key=lambda i: (i % 7, i)):  # in no particular order
            sends[i].cancel()
        await _settle()
        kept = [i for i in range(200) if i not in dropped]
        got = [(await router.recv_multipart())[1] for _ in range(queued + len(kept))]
        assert got == [b"fill"] * queued + [b"%d" % i for i in kept]
        await asyncio.gather(*(sends[i] for i in kept))
        assert await router.poll(50) == 0  # no cancelled send went out
        router.close()
        dealer.close()

    run(main())


def test_a_backlog_of_sends_goes_out_a_budget_a_turn_while_the_loop_runs_other_work(run, ctx):
    """Sends queued while no peer was connected (or behind a full pipe) all become sendable at
    once: they go out in order, at most a budget of them in one turn of the loop, so that a
    backlog of calls to one node never keeps the loop from its heartbeats and replies."""
    n = 8 * _SERVE_BUDGET

    async def main() -> None:
        dealer = LoopSocket(ctx.socket(zmq.DEALER))
        dealer.linger, dealer.sndhwm = 0, 0  # no high-water mark: only the budget stops a serve
        sends = [asyncio.create_task(dealer.send_multipart([b"%d" % i])) for i in range(n)]
        await _settle()
        assert not any(t.done() for t in sends)  # no peer yet: all queued
        done_by_turn: list[int] = []

        async def ticker() -> None:
            while True:
                done_by_turn.append(sum(t.done() for t in sends))
                await asyncio.sleep(0)

        tick = asyncio.create_task(ticker())
        router = LoopSocket(ctx.socket(zmq.ROUTER))
        router.linger, router.rcvhwm = 0, 0
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")  # every queued send can go now
        await asyncio.gather(*sends)
        tick.cancel()
        got = [(await router.recv_multipart())[1] for _ in range(n)]
        assert got == [b"%d" % i for i in range(n)]
        steps = [b - a for a, b in zip(done_by_turn, done_by_turn[1:], strict=False)]
        # One serve a turn, or two where an FD wake-up meets the continuation in one turn.
        assert max(steps) <= 2 * _SERVE_BUDGET, steps
        assert sum(1 for s in steps if s) >= 4, steps
        router.close()
        dealer.close()

    run(main())


def test_a_receive_loop_that_yields_every_burst_lets_the_loop_run_through_a_backlog(run, ctx):
    """`yield_every` in a loop that receives and starts a task per message: a backlog already
    queued is drained over many turns, not one, each turn starting at most a burst of tasks."""
    n = 10 * RECV_BURST

    async def main() -> None:
        router, dealer = _pair(ctx, router_rcvhwm=0, peer_sndhwm=0)
        for i in range(n):
            await dealer.send_multipart([b"%d" % i])
        await asyncio.sleep(0.2)  # all of them are queued at the router before it reads
        started_by_turn: list[int] = []
        started: list[asyncio.Task] = []

        async def ticker() -> None:
            while True:
                started_by_turn.append(len(started))
                await asyncio.sleep(0)

        async def receive_loop() -> None:
            handled = 0
            for _ in range(n):
                handled = await yield_every(handled)
                frames = await router.recv_multipart()
                started.append(asyncio.create_task(asyncio.sleep(0, frames[1])))

        tick = asyncio.create_task(ticker())
        await receive_loop()
        tick.cancel()
        got = [await t for t in started]
        assert got == [b"%d" % i for i in range(n)]
        steps = [b - a for a, b in zip(started_by_turn, started_by_turn[1:], strict=False)]
        assert max(steps) <= RECV_BURST, steps
        router.close()
        dealer.close()

    run(main())


def test_a_dealer_send_waits_for_its_peer_to_connect(run, ctx):
    async def main() -> None:
        dealer = LoopSocket(ctx.socket(zmq.DEALER))
        dealer.linger = 0
        hello = asyncio.create_task(dealer.send_multipart([b"hello"]))
        await _settle()
        assert not hello.done()  # no peer: a DEALER cannot send yet
        router = LoopSocket(ctx.socket(zmq.ROUTER))
        router.linger = 0
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        await asyncio.wait_for(hello, 10)
        assert (await asyncio.wait_for(router.recv_multipart(), 10))[1] == b"hello"
        router.close()
        dealer.close()

    run(main())


def test_router_mandatory_full_peer_waits_without_holding_up_others(run, ctx):
    async def main() -> None:
        router = LoopSocket(ctx.socket(zmq.ROUTER))
        router.linger = 0
        router.router_mandatory = 1
        router.sndhwm = 1
        address = f"inproc://loop-socket-{next(_inproc)}"
        router.bind(address)
        slow, fast = (LoopSocket(ctx.socket(zmq.DEALER)) for _ in range(2))
        for name, sock in [(b"slow", slow), (b"fast", fast)]:
            sock.linger, sock.rcvhwm, sock.routing_id = 0, 1, name
            sock.connect(address)
            await sock.send_multipart([b"hi"])  # the router learns the identity
            await router.recv_multipart()

        queued = 0
        while True:
            try:
                await router.send_multipart([b"slow", b"%d" % queued], flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            queued += 1
        waiting = [
            asyncio.create_task(router.send_multipart([b"slow", b"w%d" % i])) for i in (0, 1)
        ]
        await _settle()
        assert not any(w.done() for w in waiting)
        for i in range(20):  # another peer is not held up by the full one
            await asyncio.wait_for(router.send_multipart([b"fast", b"%d" % i]), 10)
            assert (await asyncio.wait_for(fast.recv_multipart(), 10)) == [b"%d" % i]
        with pytest.raises(zmq.ZMQError) as unknown:
            await router.send_multipart([b"nobody", b"x"])
        assert unknown.value.errno == zmq.EHOSTUNREACH
        got = [(await asyncio.wait_for(slow.recv_multipart(), 10))[0] for _ in range(queued + 2)]
        assert got == [b"%d" % i for i in range(queued)] + [b"w0", b"w1"]
        await asyncio.gather(*waiting)
        for s in (router, slow, fast):
            s.close()

    run(main())


def test_close_wakes_every_waiting_call_with_socket_closed(run, ctx):
    async def main() -> None:
        router, dealer = _pair(ctx, peer_sndhwm=1, router_rcvhwm=1)
        while True:
            try:
                await dealer.send_multipart([b"fill"], flags=zmq.NOBLOCK)
            except zmq.Again:
                break
        calls = [
            asyncio.create_task(dealer.recv_multipart()),
            asyncio.create_task(dealer.send_multipart([b"blocked"])),
            asyncio.create_task(dealer.poll()),
        ]
        await _settle()
        assert not any(c.done() for c in calls)
        dealer.close()
        for c in calls:
            with pytest.raises(SocketClosed):
                await asyncio.wait_for(c, 10)
        with pytest.raises(SocketClosed):
            await dealer.recv_multipart()
        with pytest.raises(SocketClosed):
            await dealer.send_multipart([b"late"])
        dealer.close()  # again: nothing happens
        assert dealer.closed
        router.close()

    run(main())


def test_poll_reports_readiness_and_leaves_the_message(run, ctx):
    async def main() -> None:
        router, dealer = _pair(ctx, tcp=True)
        assert await router.poll(0) == 0
        assert await router.poll(20) == 0  # times out: nothing there
        waiting = asyncio.create_task(router.poll(10_000))
        await _settle()
        assert not waiting.done()
        await dealer.send_multipart([b"m"])
        assert await asyncio.wait_for(waiting, 10) == zmq.POLLIN
        assert await router.poll(0) == zmq.POLLIN  # polling took nothing
        assert (await router.recv_multipart())[1] == b"m"
        assert await dealer.poll(0, zmq.POLLOUT) == zmq.POLLOUT
        router.close()
        dealer.close()

    run(main())


def test_blocking_calls_and_async_sockets_are_refused(ctx):
    sock = LoopSocket(ctx.socket(zmq.DEALER))
    with pytest.raises(AttributeError, match="send_multipart"):
        sock.send(b"x")  # would block the loop
    with pytest.raises(AttributeError, match="recv_multipart"):
        sock.recv_json()
    sock.sndhwm = 7  # options pass through
    assert sock.getsockopt(zmq.SNDHWM) == 7
    sock.close()
    actx = zmq.asyncio.Context()
    asock = actx.socket(zmq.DEALER)
    with pytest.raises(TypeError, match="socket_class=zmq.Socket"):
        LoopSocket(asock)
    asock.close()
    actx.term()


def test_one_socket_serves_one_loop(ctx):
    sock = LoopSocket(ctx.socket(zmq.DEALER))

    async def wait_briefly() -> None:
        await sock.poll(1)

    asyncio.run(wait_briefly())
    with pytest.raises(RuntimeError, match="another event loop"):
        asyncio.run(wait_briefly())
    sock.close()


def test_a_controller_ends_its_zap_thread_when_it_closes_or_fails_to_bind():
    """The ZAP handler runs on a thread of its own; the controller owning it ends it."""
    from arl.control.controller import Controller

    before = set(threading.enumerate())

    async def main() -> None:
        async with Controller() as ctl:
            assert set(threading.enumerate()) - before  # the ZAP thread runs
            port = int(ctl.address.rsplit(":", 1)[1])
            with pytest.raises(zmq.ZMQError):  # that port is taken
                await Controller(port=port).__aenter__()

    asyncio.run(main())
    assert not set(threading.enumerate()) - before
