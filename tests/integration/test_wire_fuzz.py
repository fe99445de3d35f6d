"""Malformed wire messages against a real node and a real controller (DESIGN §2, issue 8).

Against a node, the test plays the controller: it binds an authenticated ROUTER, starts one real
`arl-node` with `LocalNodes`, waits for its hello, and sends it seeded garbage. Against a
`Controller`, it plays nodes: one authenticated DEALER that said hello, and one that never did.
Afterwards both sides still answer valid messages, the node's memory did not run away, and every
malformed message whose request id was readable got exactly one `err` back.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgpack
import torch
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from arl.control.controller import Controller
from arl.control.launcher import LocalNodes
from arl.wire import codec
from arl.wire.codec import OPS, Message, decode_message, encode_message
from arl.wire.sockets import Authenticator, Security, bind_tcp, make_socket, new_secret

N_MESSAGES = 10_000
BATCH = 200
FUZZ_ID_BASE = 1_000_000  # ids of malformed messages; sentinels use small ids
RSS_MARGIN_KB = 200 * 1024


# ---- the generator --------------------------------------------------------------------------


def _junk(rng: random.Random, depth: int = 0) -> Any:
    """A random msgpack-able value (never a tensor)."""
    kind = rng.randrange(8 if depth < 3 else 6)
    if kind == 0:
        return rng.choice([0, -1, 1, 2**31, -(2**63), 2**64 - 1, rng.randrange(-1000, 1000)])
    if kind == 1:
        return rng.choice([0.0, -1.5, 1e308, float("inf"), float("nan"), rng.random()])
    if kind == 2:
        return "".join(rng.choice("ab_:.xyz/\\\x00é") for _ in range(rng.randrange(12)))
    if kind == 3:
        return rng.randbytes(rng.randrange(16))
    if kind == 4:
        return None
    if kind == 5:
        return rng.random() < 0.5
    if kind == 6:
        return [_junk(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {str(_junk(rng, 3)): _junk(rng, depth + 1) for _ in range(rng.randrange(4))}


def _ext(code: int, meta: Any) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(meta, use_bin_type=True))


class Fuzzer:
    """Seeded malformed multipart messages, each tagged with the id a receiver can read (or None).

    ``target`` is "node" (we play the controller) or "controller" (we play a node); it picks the
    valid-header cases that each side must refuse: garbage create/call args for a node, calls and
    bad hellos for a controller.
    """

    def __init__(self, seed: int, target: str):
        self.rng = random.Random(seed)
        self.target = target
        self._ids = itertools.count(FUZZ_ID_BASE)
        self.sent: collections.Counter[str] = collections.Counter()
        cases: list[Callable[[], tuple[list[bytes], int | None]]] = [
            self.truncated,
            self.random_bytes,
            self.wrong_frame_count,
            self.frame_size_mismatch,
            self.huge_shape,
            self.bad_descriptor,
            self.unknown_op,
            self.wrong_version,
            self.wrong_field_types,
        ]
        if target == "node":
            cases += [self.garbage_create, self.garbage_call, self.unexpected_op]
        else:
            cases += [self.call_to_controller, self.bad_hello]
        self.cases = cases

    def __call__(self) -> tuple[list[bytes], int | None]:
        case = self.rng.choice(self.cases)
        self.sent[case.__name__] += 1
        return case()

    # -- helpers
    def _id(self) -> int:
        return next(self._ids)

    def _head(self, mid: int, **fields: Any) -> bytes:
        head = {"v": codec.PROTOCOL_VERSION, "id": mid, "op": "call", "m": "ping", "a": {}}
        head.update(fields)
        return msgpack.packb(head, use_bin_type=True)

    def _valid(self, mid: int) -> list[bytes]:
        """A well-formed call with one to three tensors that travel as frames."""
        tensors = [
            torch.arange(
                self.rng.randrange(70, 300), dtype=self.rng.choice([torch.float32, torch.int64])
            )
            for _ in range(self.rng.randrange(1, 4))
        ]
        args = {"obj": "echo", "method": "echo", "args": tensors, "kwargs": {}}
        return [bytes(memoryview(f)) for f in encode_message(Message("call", mid, "call", args))]

    # -- cases every receiver must refuse
    def truncated(self) -> tuple[list[bytes], int | None]:
        frames = self._valid(self._id())
        cut = self.rng.randrange(len(frames[0]))
        return [frames[0][:cut], *frames[1:]], None

    def random_bytes(self) -> tuple[list[bytes], int | None]:
        n = self.rng.randrange(1, 5)
        return [self.rng.randbytes(self.rng.randrange(64)) for _ in range(n)], None

    def wrong_frame_count(self) -> tuple[list[bytes], int | None]:
        mid = self._id()
        frames = self._valid(mid)
        if self.rng.random() < 0.5:
            del frames[self.rng.randrange(1, len(frames))]
        else:
            frames += [
                self.rng.randbytes(self.rng.randrange(64)) for _ in range(self.rng.randrange(1, 4))
            ]
        return frames, mid

    def frame_size_mismatch(self) -> tuple[list[bytes], int | None]:
        mid = self._id()
        frames = self._valid(mid)
        i = self.rng.randrange(1, len(frames))
        size = len(frames[i])
        new = self.rng.choice([0, 1, size - 1, size + 1, size // 2, size * 2, size + 3])
        frames[i] = self.rng.randbytes(new)
        return frames, mid

    def huge_shape(self) -> tuple[list[bytes], int | None]:
        mid = self._id()
        shape = self.rng.choice(
            [
                [2 ** self.rng.randrange(41, 64)],
                [1 << 21, 1 << 21, 1 << 21],
                [0, 2**63],
                [2**64 - 1, 0],
                [1 << 20] * self.rng.randrange(3, 30),
            ]
        )
        code = self.rng.choice([codec._EXT_FRAME, codec._EXT_INLINE])
        meta = ["float32", shape, 1 if code == codec._EXT_FRAME else b"\0" * 8]
        return [self._head(mid, a={"t": _ext(code, meta)}), b"\0" * 8], mid

    def bad_descriptor(self) -> tuple[list[bytes], int | None]:
        mid = self._id()
        r = self.rng.randrange(7)
        extra: list[bytes] = [b"\0" * 8]
        if r == 0:
            ext = msgpack.ExtType(self.rng.choice([0, 3, 4, 17, 127]), self.rng.randbytes(4))
        elif r == 1:
            ext = msgpack.ExtType(codec._EXT_FRAME, self.rng.randbytes(self.rng.randrange(12)))
        elif r == 2:
            ext = _ext(codec._EXT_FRAME, _junk(self.rng))
        elif r == 3:
            dtype = self.rng.choice(["float128", "", "torch.float32", 7, None, ["float32"]])
            ext = _ext(codec._EXT_FRAME, [dtype, [2], 1])
        elif r == 4:
            shape = self.rng.choice([[-1], [2, -3], "2", None, [1.5], [[2]], [True, 2]])
            ext = _ext(codec._EXT_FRAME, ["float32", shape, 1])
        elif r == 5:
            ext = _ext(
                codec._EXT_FRAME, ["float32", [2], self.rng.choice([0, -1, 2, 99, "1", None])]
            )
        else:
            n = self.rng.choice([0, 3, 9, 100])
            ext = _ext(codec._EXT_INLINE, ["float32", [2], b"\0" * n])  # needs 8 bytes
            extra = []
        return [self._head(mid, a={"args": [ext]}), *extra], mid

    def unknown_op(self) -> tuple[list[bytes], int | None]:
        mid = self._id()
        op = self.rng.choice(["CALL", "", "call ", "ok!", "frob", "\x00", "helo", "hb2"])
        if self.rng.random() < 0.3:
            op = "".join(
                self.rng.choice("abcdefghijklmnop") for _ in range(self.rng.randrange(1, 9))
            )
        if op in OPS:
            op += "?"
        return [self._head(mid, op=op)], mid

    def wrong_version(self) -> tuple[list[bytes], int | None]:
        mid = self._id()
        if self.rng.random() < 0.1:
            return [msgpack.packb({"id": mid, "op": "call", "m": "ping", "a": {}})], mid
        v = self.rng.choice([0, 2, 3, -1, 255, 2**40, "1", None, [1], {"v": 1}, b"\x01"])
        return [self._head(mid, v=v)], mid

    def wrong_field_types(self) -> tuple[list[bytes], int | None]:
        mid = self._id()
        r = self.rng.randrange(4)
        if r == 0:
            bad = self.rng.choice([3, None, ["call"], b"call", 1.5])
            return [self._head(mid, op=bad)], mid
        if r == 1:
            bad = self.rng.choice([3, None, ["ping"], b"ping", {"m": 1}])
            return [self._head(mid, m=bad)], mid
        if r == 2:  # an id nobody can read: no reply is possible
            bad = self.rng.choice(["7", 7.0, [7], None, b"\x07", {"id": 7}])
            return [self._head(mid, id=bad)], None
        header = self.rng.choice([[1, mid, "call"], mid, "call", b"\x00", None, 1.5])
        return [msgpack.packb(header, use_bin_type=True)], None

    # -- valid headers a node must answer with err
    def garbage_create(self) -> tuple[list[bytes], int | None]:
        mid = self._id()
        target = self.rng.choice(
            [
                "os:system",
                "subprocess:run",
                "builtins:eval",
                "tests.support:Nope",
                "arl.no_such_module_xyz:Thing",
                "arl.wire.codec:NoSuchThing",
                "no-colon",
                ":",
                "arl.:",
                "",
                7,
                None,
                ["arl.wire.codec", "pack"],
            ]
        )
        a: Any = {"name": f"obj{mid}", "target": target, "args": _junk(self.rng), "kwargs": {}}
        r = self.rng.randrange(5)
        if r == 1:
            a = {"name": "echo", "target": "tests.support.objects:Echo"}  # name taken
        elif r == 2:
            a = {"name": [1, 2], "target": "tests.support.objects:Echo"}  # unhashable name
        elif r == 3:
            a = self.rng.choice([[1, 2], "create", 5, b"x", {"target": "x:y"}])
        return [self._head(mid, m="create", a=a)], mid

    def garbage_call(self) -> tuple[list[bytes], int | None]:
        mid = self._id()
        r = self.rng.randrange(9)
        call: Any = {"obj": "echo", "method": "echo", "args": [1], "kwargs": {}}
        if r == 0:
            call["obj"] = self.rng.choice(["nope", "", "ECHO", f"x{mid}"])
        elif r == 1:
            call["obj"] = self.rng.choice([[1], {"a": 1}])  # unhashable
        elif r == 2:
            call["method"] = self.rng.choice(["_private", "__init__", "__class__", "__dict__"])
        elif r == 3:
            call["method"] = self.rng.choice(["nope", "tag", "calls", ""])  # missing / not callable
        elif r == 4:
            call["args"] = self.rng.choice([[], [1, 2, 3], 5, 1.5, None, True])  # arity / type
        elif r == 5:
            call["kwargs"] = self.rng.choice([[1], {"nope": 1}, {"value": 1}, "kw"])
        elif r == 6:
            call["method"], call["args"] = "fail", [_junk(self.rng)]  # raises by design
        elif r == 7:
            call = self.rng.choice([[1], "call", 5, b"", {"obj": "echo"}])
        else:
            return [self._head(mid, m=self.rng.choice(["nope", "", "Ping", "__init__"]))], mid
        method = self.rng.choice(["call", "destroy"]) if r == 1 else "call"
        if method == "destroy":
            call = {"name": [1, 2]}
        return [self._head(mid, m=method, a=call)], mid

    def unexpected_op(self) -> tuple[list[bytes], int | None]:
        mid = self._id()  # valid ops that a node never accepts from the controller
        return [self._head(mid, op=self.rng.choice(["hello", "event"]), a=_junk(self.rng))], mid

    # -- valid headers a controller must answer with err
    def call_to_controller(self) -> tuple[list[bytes], int | None]:
        mid = self._id()
        return [self._head(mid, m=self.rng.choice(["ping", "create", "x"]), a=_junk(self.rng))], mid

    def bad_hello(self) -> tuple[list[bytes], int | None]:
        mid = self._id()
        args = self.rng.choice([None, 5, "node", [1], {"node_id": 5}, {"node_id": [1]}, b"x"])
        return [self._head(mid, op="hello", m="hello", a=args)], mid


# ---- playing the controller against a real node -------------------------------------------


class FakeController:
    """The test's side of a node's control link: a ROUTER that records every reply by id."""

    def __init__(self, router: zmq.asyncio.Socket):
        self.router = router
        self.identity = b""
        self.hello: dict = {}
        self.replies: dict[int, list[Message]] = collections.defaultdict(list)

    async def wait_hello(self, timeout: float = 90.0) -> dict:
        deadline = time.monotonic() + timeout
        while not self.hello:
            frames = await asyncio.wait_for(
                self.router.recv_multipart(), deadline - time.monotonic()
            )
            msg = decode_message(frames[1:])
            if msg.op == "hello":
                self.identity, self.hello = frames[0], msg.args
                await self.send(encode_message(Message("ok", msg.id, "hello", {})))
        return self.hello

    async def send(self, frames: list[Any]) -> None:
        await self.router.send_multipart([self.identity, *frames], copy=False)

    async def receive_until(self, done: Callable[[], bool], timeout: float) -> None:
        """Record replies until ``done()`` or the deadline."""
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if not await self.router.poll(left * 1000):
                return
            frames = await self.router.recv_multipart()
            msg = decode_message(frames[1:])  # a node's own messages are always well-formed
            if msg.op in ("ok", "err"):
                self.replies[msg.id].append(msg)

    async def call(self, mid: int, method: str, args: Any, timeout: float = 30.0) -> Message:
        await self.send(encode_message(Message("call", mid, method, args)))
        await self.receive_until(lambda: mid in self.replies, timeout)
        assert mid in self.replies, f"no reply to {method} (id {mid}) within {timeout}s"
        return self.replies[mid][-1]


@asynccontextmanager
async def node_under_test(
    max_message_bytes: int = -1,
) -> AsyncIterator[tuple[FakeController, LocalNodes, Security]]:
    """One real node connected to the test's authenticated ROUTER."""
    security = Security(new_secret())
    ctx = zmq.asyncio.Context()
    auth = Authenticator(ctx, security)
    router = make_socket(ctx, zmq.ROUTER, security, server=True)
    try:
        address = bind_tcp(router, "127.0.0.1")
        async with LocalNodes(
            address,
            security,
            [{"OMP_NUM_THREADS": "1"}],
            allowed_prefixes=("arl.", "tests."),
            heartbeat_interval=1.0,
            heartbeat_timeout=120.0,  # garbage keeps it fed; long waits must not end it
            max_message_bytes=max_message_bytes,
        ) as procs:
            peer = FakeController(router)
            await peer.wait_hello()
            yield peer, procs, security
    finally:
        auth.stop()
        router.close(0)
        ctx.destroy(linger=0)


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_node_survives_10000_malformed_messages():
    async def main() -> None:
        async with node_under_test() as (peer, procs, _):
            pid = procs.pids[0]
            assert peer.hello["pid"] == pid
            ok = await peer.call(
                1, "create", {"name": "echo", "target": "tests.support.objects:Echo"}
            )
            assert ok.op == "ok", ok
            assert (await peer.call(2, "ping", {})).op == "ok"
            rss_before = _rss_kb(pid)

            fuzz = Fuzzer(seed=20240611, target="node")
            expected: set[int] = set()
            sentinels = itertools.count(10)
            for start in range(0, N_MESSAGES, BATCH):
                for _ in range(min(BATCH, N_MESSAGES - start)):
                    frames, mid = fuzz()
                    if mid is not None:
                        expected.add(mid)
                    await peer.send(frames)
                # A valid ping after each batch paces the sender and proves the node still serves.
                assert (await peer.call(next(sentinels), "ping", {})).op == "ok"
            await peer.receive_until(lambda: expected <= peer.replies.keys(), 60)

            fuzz_replies = {mid: r for mid, r in peer.replies.items() if mid >= FUZZ_ID_BASE}
            missing = sorted(expected - fuzz_replies.keys())
            assert not missing, f"{len(missing)} malformed messages got no err, e.g. {missing[:5]}"
            assert fuzz_replies.keys() == expected  # nothing answered an unreadable id
            for mid, replies in fuzz_replies.items():
                assert [r.op for r in replies] == ["err"], (mid, replies)
                assert {"type", "message", "traceback"} <= replies[0].args.keys()
            assert len(expected) > N_MESSAGES // 2, fuzz.sent
            assert set(fuzz.sent) == {c.__name__ for c in fuzz.cases}, fuzz.sent

            # Still alive, still correct, and memory did not run away.
            assert procs.procs[0].returncode is None
            t = torch.randn(64, 65)
            back = await peer.call(3, "call", {"obj": "echo", "method": "echo", "args": [t]})
            assert back.op == "ok" and torch.equal(back.args, t)
            growth = _rss_kb(pid) - rss_before
            print(f"node: {len(expected)} err replies, RSS {rss_before} kB -> +{growth} kB")
            assert growth < RSS_MARGIN_KB, (
                f"node RSS grew by {growth} kB over {N_MESSAGES} messages"
            )

    asyncio.run(main())


# ---- playing nodes against a real controller ----------------------------------------------


async def _dealer(
    ctx: zmq.asyncio.Context, security: Security, address: str, identity: bytes
) -> zmq.asyncio.Socket:
    sock = make_socket(ctx, zmq.DEALER, security, server=False)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.connect(address)
    return sock


async def _replies_until(
    sock: zmq.asyncio.Socket,
    replies: dict[int, list[Message]],
    want: set[int],
    timeout: float,
) -> None:
    """Record replies (by request id) arriving on ``sock`` until every id in ``want`` has one."""
    deadline = time.monotonic() + timeout
    while not want <= replies.keys():
        left = deadline - time.monotonic()
        if left <= 0 or not await sock.poll(left * 1000):
            return
        msg = decode_message(await sock.recv_multipart())
        if msg.op in ("ok", "err"):
            replies[msg.id].append(msg)


def test_controller_survives_10000_malformed_messages():
    async def main() -> None:
        security = Security(new_secret())
        async with Controller(security, heartbeat_interval=0.5, heartbeat_timeout=120) as ctl:
            ctx = zmq.asyncio.Context()
            member = await _dealer(ctx, security, ctl.address, b"fuzz-node")
            stranger = await _dealer(ctx, security, ctl.address, b"stranger")
            try:
                await member.send_multipart(
                    encode_message(Message("hello", 1, "hello", {"node_id": "fuzz-node", "pid": 1}))
                )
                replies: dict[bytes, dict[int, list[Message]]] = {
                    b"fuzz-node": collections.defaultdict(list),
                    b"stranger": collections.defaultdict(list),
                }
                await _replies_until(member, replies[b"fuzz-node"], {1}, 30)
                assert [m.op for m in replies[b"fuzz-node"][1]] == ["ok"]
                assert [n.node_id for n in ctl.live_nodes()] == ["fuzz-node"]
                dropped_before = ctl.dropped

                expected: dict[bytes, set[int]] = {b"fuzz-node": set(), b"stranger": set()}
                fuzz = Fuzzer(seed=4242, target="controller")
                sentinels = itertools.count(10)
                sent = 0
                while sent < N_MESSAGES:
                    for who, sock in ((b"fuzz-node", member), (b"stranger", stranger)):
                        for _ in range(BATCH // 2):
                            frames, mid = fuzz()
                            if mid is not None:
                                expected[who].add(mid)
                            await sock.send_multipart(frames)
                            sent += 1
                        # A call is refused with err: a valid round trip that paces the sender.
                        s = next(sentinels)
                        await sock.send_multipart(encode_message(Message("call", s, "ping", {})))
                        await _replies_until(sock, replies[who], {s}, 30)
                        assert [m.op for m in replies[who][s]] == ["err"]
                    await member.send_multipart(
                        encode_message(Message("hb", 0, "hb", {"alive": 1}))
                    )

                for who, sock in ((b"fuzz-node", member), (b"stranger", stranger)):
                    got = replies[who]
                    await _replies_until(sock, got, expected[who], 60)
                    fuzz_got = {mid: r for mid, r in got.items() if mid >= FUZZ_ID_BASE}
                    missing = sorted(expected[who] - fuzz_got.keys())
                    assert not missing, f"{who!r}: {len(missing)} got no err, e.g. {missing[:5]}"
                    assert fuzz_got.keys() == expected[who]
                    for mid, rs in fuzz_got.items():
                        assert [r.op for r in rs] == ["err"], (who, mid, rs)
                n_sentinels = next(sentinels) - 10
                print(f"controller: {sent} sent, err replies {[len(v) for v in expected.values()]}")
                assert ctl.dropped - dropped_before == sent + n_sentinels  # each counted once
                assert sum(map(len, expected.values())) > N_MESSAGES // 2, fuzz.sent

                # Only the member is a node; it is not lost, and a fresh node can still join.
                assert [n.node_id for n in ctl.live_nodes()] == ["fuzz-node"]
                assert set(ctl.nodes) == {"fuzz-node"}
                fresh = await _dealer(ctx, security, ctl.address, b"fresh")
                try:
                    await fresh.send_multipart(
                        encode_message(Message("hello", 5, "hello", {"node_id": "fresh"}))
                    )
                    await ctl.wait_for_nodes(2, timeout=30)
                    assert await _reply(fresh, 5) == "ok"
                finally:
                    fresh.close(0)
                # The controller still makes calls to the member, and gets its answer.
                call = asyncio.create_task(ctl.call("fuzz-node", "ping", {}, timeout=30))
                while True:
                    msg = decode_message(await member.recv_multipart())
                    if msg.op == "call":
                        break
                await member.send_multipart(
                    encode_message(Message("ok", msg.id, "ping", {"up": 1}))
                )
                assert await call == {"up": 1}
            finally:
                member.close(0)
                stranger.close(0)
                ctx.destroy(linger=0)

    asyncio.run(main())


async def _reply(sock: zmq.asyncio.Socket, mid: int, timeout: float = 30) -> str:
    """The op of the reply to request ``mid`` (heartbeats in between are skipped)."""
    replies: dict[int, list[Message]] = collections.defaultdict(list)
    await _replies_until(sock, replies, {mid}, timeout)
    assert mid in replies, f"no reply to request {mid} within {timeout}s"
    return replies[mid][0].op


# ---- maximum message size -----------------------------------------------------------------


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


async def _monitor_events(mon: zmq.asyncio.Socket, want: int, timeout: float) -> list[int]:
    """Monitor events until one equals ``want`` or the deadline; returns all seen."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    while want not in seen:
        left = deadline - time.monotonic()
        if left <= 0 or not await mon.poll(left * 1000):
            break
        seen.append((await recv_monitor_message(mon))["event"])
    return seen


def test_node_enforces_max_message_bytes():
    limit = 1 << 20

    async def main() -> None:
        async with node_under_test(max_message_bytes=limit) as (peer, procs, security):
            ok = await peer.call(
                1, "create", {"name": "echo", "target": "tests.support.objects:Echo"}
            )
            assert ok.op == "ok"
            small = torch.zeros(limit // 8, dtype=torch.int32)  # well under the limit
            assert (
                await peer.call(2, "call", {"obj": "echo", "method": "checksum", "args": [small]})
            ).op == "ok"
            # One oversize frame, and many small frames that are oversize together.
            big = torch.zeros(limit // 4 + 1, dtype=torch.float32)
            reply = await peer.call(3, "call", {"obj": "echo", "method": "checksum", "args": [big]})
            assert reply.op == "err" and "exceeds max_message_bytes" in reply.args["message"]
            parts = [torch.zeros(limit // 16, dtype=torch.float32) for _ in range(6)]
            reply = await peer.call(4, "call", {"obj": "echo", "method": "echo", "args": parts})
            assert reply.op == "err" and "max_message_bytes=1048576" in reply.args["message"]
            # The node keeps serving on its control link.
            assert (
                await peer.call(5, "call", {"obj": "echo", "method": "echo", "args": [7]})
            ).args == 7

            # Its data-plane ROUTER drops the connection of a peer that sends an oversize frame.
            ctx = zmq.asyncio.Context()
            try:
                client = make_socket(ctx, zmq.DEALER, security, server=False)
                mon = _monitor(client)
                client.connect(peer.hello["data_addr"])
                seen = await _monitor_events(mon, zmq.EVENT_HANDSHAKE_SUCCEEDED, 30)
                assert zmq.EVENT_HANDSHAKE_SUCCEEDED in seen, seen
                await client.send_multipart([b"x" * (2 * limit)])
                seen = await _monitor_events(mon, zmq.EVENT_DISCONNECTED, 30)
                assert zmq.EVENT_DISCONNECTED in seen, seen
                client.close(0)
                mon.close(0)
            finally:
                ctx.destroy(linger=0)
            assert procs.procs[0].returncode is None
            assert (await peer.call(6, "ping", {})).op == "ok"

    asyncio.run(main())


def test_controller_enforces_max_message_bytes():
    limit = 1 << 20

    async def main() -> None:
        security = Security(new_secret())
        async with Controller(security, heartbeat_timeout=60, max_message_bytes=limit) as ctl:
            ctx = zmq.asyncio.Context()
            node = await _dealer(ctx, security, ctl.address, b"big-node")
            mon = _monitor(node)
            try:
                await node.send_multipart(
                    encode_message(Message("hello", 1, "hello", {"node_id": "big-node"}))
                )
                await ctl.wait_for_nodes(1, timeout=30)
                assert await _reply(node, 1) == "ok"
                dropped, bytes_in = ctl.dropped, ctl.bytes_in

                # A frame over the limit: libzmq drops the connection before arl sees a byte.
                await node.send_multipart(
                    encode_message(
                        Message("event", 0, "blob", torch.ones(limit + 1, dtype=torch.uint8))
                    )
                )
                seen = await _monitor_events(mon, zmq.EVENT_DISCONNECTED, 30)
                assert zmq.EVENT_DISCONNECTED in seen, seen
                assert (ctl.dropped, ctl.bytes_in) == (dropped, bytes_in)

                # The node reconnects by itself; frames each under the limit but oversize
                # together are refused by the controller with an err naming the limit.
                seen = await _monitor_events(mon, zmq.EVENT_HANDSHAKE_SUCCEEDED, 30)
                assert zmq.EVENT_HANDSHAKE_SUCCEEDED in seen, seen
                parts = [torch.zeros(limit // 8, dtype=torch.float32) for _ in range(3)]
                await node.send_multipart(encode_message(Message("call", 9, "x", parts)))
                replies: dict[int, list[Message]] = collections.defaultdict(list)
                await _replies_until(node, replies, {9}, 30)
                assert "exceeds max_message_bytes" in replies[9][0].args["message"]
                assert ctl.dropped == dropped + 1

                # The controller keeps serving the node.
                call = asyncio.create_task(ctl.call("big-node", "ping", {}, timeout=30))
                while True:
                    msg = decode_message(await node.recv_multipart())
                    if msg.op == "call":
                        break
                await node.send_multipart(encode_message(Message("ok", msg.id, "ping", "pong")))
                assert await call == "pong"
                assert [n.node_id for n in ctl.live_nodes()] == ["big-node"]
            finally:
                node.close(0)
                mon.close(0)
                ctx.destroy(linger=0)

    asyncio.run(main())
