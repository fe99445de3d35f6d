"""Shard pulls over the real data plane: ROUTER server task, DEALER client, tcp on 127.0.0.1."""

import asyncio
import os
import re
import signal
import subprocess
import sys
import uuid
from contextlib import asynccontextmanager

import pytest
import torch
import zmq
import zmq.asyncio

from arl.node.data_plane import (
    DataPlaneClient,
    DataPlaneServer,
    OwnerLost,
    ShardUnavailable,
    _Peer,
    plan_chunks,
)
from arl.node.shard_store import ShardStore, sweep_orphans
from arl.protocol.rtensor import RTensor, ShardRef
from arl.wire.sockets import Authenticator, Security, bind_tcp, make_socket, new_secret

# Shared verbatim with the owner subprocess, so both sides build the same tensors.
MAKE_SHARDS = """
def make_shards(n, big=20_000):
    import torch
    out = {}
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        L = big if i == 1 else 5 + 37 * i
        out[f"g{i}"] = {
            "input_ids": torch.randint(0, 2**31, (4, L), generator=g),
            "logprobs": torch.randn(4, L, generator=g).to(torch.bfloat16),
            "f16": torch.randn(3, L, generator=g).half(),
            "mask": torch.rand(4, L, generator=g) > 0.5,
            "adv": torch.randn(4, generator=g, dtype=torch.float64),
            "i32": torch.randint(-5, 5, (L,), generator=g, dtype=torch.int32),
            "u8": torch.randint(0, 255, (L,), generator=g, dtype=torch.uint8),
            "scalar": torch.tensor(float(i)),
            "empty": torch.empty(0, 2),
        }
    return out
"""
exec(MAKE_SHARDS)
CHUNK = 64 << 10  # small, so the big shard spans several chunks and small ones share one


def _run_id() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


def _held(store: ShardStore) -> tuple[int, int]:
    st = store.stats()
    return st["bytes_held"], st["n_shards"]


def _assert_bit_identical(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), name


def _refs(node: str, store: ShardStore, keys: list[str]) -> list[ShardRef]:
    return [ShardRef.from_meta(node, store.entry(k).meta) for k in keys]


@asynccontextmanager
async def _node(ctx: zmq.asyncio.Context, security: Security, node_id: str, run_id: str):
    """A store served on 127.0.0.1, with a client: one node's data plane in this process."""
    store = ShardStore(run_id, node_id)
    sock = make_socket(ctx, zmq.ROUTER, security, server=True)
    addr = bind_tcp(sock, "127.0.0.1")
    server = DataPlaneServer(store, sock, chunk_bytes=CHUNK)
    server.start()
    client = DataPlaneClient(store, ctx=ctx, security=security, timeout=5.0)
    try:
        yield store, addr, client
    finally:
        await client.close()
        await server.close()
        sock.close(0)
        store.close()


@asynccontextmanager
async def _context():
    ctx = zmq.asyncio.Context()
    security = Security(new_secret())
    auth = Authenticator(ctx, security)
    try:
        yield ctx, security
    finally:
        auth.stop()
        ctx.term()


@asynccontextmanager
async def _tcp_client(run_id: str, secret: str):
    """A trainer-side store and a TCP-only client with a 60 s timeout, closed on exit."""
    ctx = zmq.asyncio.Context()
    store = ShardStore(run_id, "trainer")
    security = Security(secret)
    client = DataPlaneClient(store, ctx=ctx, security=security, timeout=60.0, force_tcp=True)
    try:
        yield store, client
    finally:
        await client.close()
        store.close()
        ctx.destroy(linger=0)


def test_plan_chunks_packs_small_and_splits_large() -> None:
    assert plan_chunks([3, 10, 2], 4) == [
        [[0, 0, 3], [1, 0, 1]],
        [[1, 1, 4]],
        [[1, 5, 4]],
        [[1, 9, 1], [2, 0, 2]],
    ]
    assert plan_chunks([], 4) == [] and plan_chunks([0, 0], 4) == []


@pytest.mark.parametrize("force_tcp", [False, True], ids=["shm", "tcp"])
def test_pull_in_one_process_is_bit_identical(force_tcp: bool) -> None:
    async def main() -> None:
        run_id = _run_id()
        shards = make_shards(5)  # noqa: F821 (defined by exec above)
        async with (
            _context() as (ctx, sec),
            _node(ctx, sec, "owner", run_id) as (
                owner,
                addr,
                _,
            ),
            _node(ctx, sec, "trainer", run_id) as (mine, _, client),
        ):
            client.force_tcp = force_tcp
            for k, s in shards.items():
                owner.put(k, s)
            keys = list(shards)
            refs = _refs("owner", owner, keys) + _refs("owner", owner, keys[:2])  # repeats
            batch = RTensor(refs, peers={"owner": addr})
            got = await client.pull(batch)
            assert len(got) == len(refs)
            for ref, tensors in zip(refs, got, strict=True):
                _assert_bit_identical(tensors, shards[ref.key])
            held = owner.stats()["bytes_held"]
            assert _held(mine) == (held, 5)

            # Shared memory maps the owner's pages; tcp gave the consumer its own bytes.
            owner.get("g0")["u8"][0] = 255 - shards["g0"]["u8"][0]
            changed = mine.get("g0")["u8"][0] != shards["g0"]["u8"][0]
            assert bool(changed) is (not force_tcp)

            # The owner frees; the consumer's copies stay valid until it frees them too.
            owner.free(keys)
            _assert_bit_identical(mine.get("g1"), shards["g1"])
            assert mine.free(keys + keys) == held
            assert _held(mine) == (0, 0)

    asyncio.run(main())


def test_pull_from_several_owners_and_missing_key() -> None:
    async def main() -> None:
        run_id = _run_id()
        shards = make_shards(4, big=3000)  # noqa: F821
        async with (
            _context() as (ctx, sec),
            _node(ctx, sec, "r0", run_id) as (
                r0,
                a0,
                _,
            ),
            _node(ctx, sec, "r1", run_id) as (r1, a1, _),
            _node(ctx, sec, "t0", run_id) as (
                mine,
                _,
                client,
            ),
        ):
            r0.put("g0", shards["g0"])
            r0.put("g2", shards["g2"])
            r1.put("g1", shards["g1"])
            r1.put("g3", shards["g3"])
            refs = [
                ShardRef.from_meta(n, s.entry(k).meta)
                for n, s, k in [
                    ("r0", r0, "g0"),
                    ("r1", r1, "g1"),
                    ("r0", r0, "g2"),
                    ("r1", r1, "g3"),
                ]
            ]
            peers = {"r0": a0, "r1": a1}
            got = await client.pull(RTensor(refs, peers=peers))
            for k, tensors in zip(["g0", "g1", "g2", "g3"], got, strict=True):
                _assert_bit_identical(tensors, shards[k])
            mine.free(["g0", "g1", "g2", "g3"])

            # A freed key: the error names the owner node and the key; nothing is left behind.
            r1.free(["g3"])
            with pytest.raises(ShardUnavailable, match="'g3' on node 'r1'") as e:
                await client.pull(RTensor(refs, peers=peers))
            assert e.value.node == "r1" and e.value.key == "g3"
            assert "does not hold" in str(e.value) and not isinstance(e.value, OwnerLost)
            assert _held(mine) == (0, 0)

            # An owner the RTensor gives no address for.
            with pytest.raises(ShardUnavailable, match="no data-plane address"):
                await client.pull(RTensor(refs[:1], peers={}))

    asyncio.run(main())


def test_unmappable_segment_falls_back_to_tcp(tmp_path) -> None:
    async def main() -> None:
        run_id = _run_id()
        shards = make_shards(3, big=3000)  # noqa: F821
        async with (
            _context() as (ctx, sec),
            _node(ctx, sec, "owner", run_id) as (
                owner,
                addr,
                _,
            ),
        ):
            for k, s in shards.items():
                owner.put(k, s)
            # Same host id, but the consumer cannot see the owner's /dev/shm (another mount).
            mine = ShardStore(run_id, "elsewhere", shm_dir=str(tmp_path))
            client = DataPlaneClient(mine, ctx=ctx, security=sec, timeout=5.0)
            try:
                got = await client.pull_shards(_refs("owner", owner, list(shards)), {"owner": addr})
                for k, tensors in got.items():
                    _assert_bit_identical(tensors, shards[k])
                owner.get("g0")["u8"][0] = 255 - shards["g0"]["u8"][0]
                assert mine.get("g0")["u8"][0] == shards["g0"]["u8"][0]  # its own bytes
            finally:
                await client.close()
                mine.close()

    asyncio.run(main())


_OWNER = (
    MAKE_SHARDS
    + """
import asyncio, os, sys
import zmq, zmq.asyncio
from arl.node.data_plane import DataPlaneServer
from arl.node.shard_store import ShardStore, sweep_orphans
from arl.wire.sockets import Authenticator, Security, bind_tcp, make_socket

async def main():
    ctx = zmq.asyncio.Context()
    security = Security(os.environ["ARL_SECRET"])
    auth = Authenticator(ctx, security)
    store = ShardStore(sys.argv[1], "rollout-7")
    for k, s in make_shards(4).items():
        store.put(k, s)
    sock = make_socket(ctx, zmq.ROUTER, security, server=True)
    addr = bind_tcp(sock, "127.0.0.1", int(sys.argv[3]))
    server_class = DataPlaneServer
    if sys.argv[4:] == ["exit-after-pull"]:
        class server_class(DataPlaneServer):
            async def _pull(self, *args):
                await super()._pull(*args)
                sock.close(-1)  # lingers: the reply queued above still goes out
                auth.stop()
                ctx.term()  # returns once it has
                store.close()
                os._exit(0)
    server = server_class(store, sock, chunk_bytes=int(sys.argv[2]))
    server.start()
    print(addr, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.close()
    sock.close(0)
    auth.stop()
    ctx.term()
    store.close()

asyncio.run(main())
"""
)


def _start_owner(
    run_id: str, secret: str, port: int = 0, *mode: str
) -> tuple[subprocess.Popen, str]:
    """Node 'rollout-7' in a child process, holding make_shards(4), on 127.0.0.1:``port``;
    mode ``exit-after-pull``: the process exits once it has sent its first pull reply."""
    env = {
        **os.environ,
        "ARL_SECRET": secret,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", _OWNER, run_id, str(CHUNK), str(port), *mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    addr = proc.stdout.readline().decode().strip()
    if not addr.startswith("tcp://127.0.0.1:"):
        proc.kill()
        proc.wait()
        raise AssertionError(f"the owner process did not start: {addr!r}")
    return proc, addr


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_pull_across_processes_shm_and_tcp_then_owner_dies() -> None:
    run_id = _run_id()
    secret = new_secret()
    proc, addr = _start_owner(run_id, secret)
    shards = make_shards(4)  # noqa: F821

    async def main(addr: str) -> None:
        ctx = zmq.asyncio.Context()
        security = Security(secret)
        refs = [
            ShardRef("rollout-7", k, sum(t.nbytes for t in s.values()), 0)
            for k, s in shards.items()
        ]
        batch = RTensor(refs, peers={"rollout-7": addr})
        try:
            for force_tcp in (False, True):
                store = ShardStore(run_id, f"trainer-{force_tcp}")
                client = DataPlaneClient(
                    store, ctx=ctx, security=security, timeout=3.0, force_tcp=force_tcp
                )
                got = await client.pull(batch)
                for ref, tensors in zip(refs, got, strict=True):
                    _assert_bit_identical(tensors, shards[ref.key])
                assert store.stats()["n_shards"] == 4
                # The shm pull maps the owner's 4 segments; the tcp pull maps nothing more.
                with open("/proc/self/maps") as f:
                    assert f.read().count(f"/dev/shm/arl-{run_id}-{proc.pid}-") == 4
                # Keep the shm copies mapped while the owner dies below.
                if not force_tcp:
                    shm_store, shm_client = store, client
                else:
                    store.free(list(shards))
                    await client.close()
                    store.close()

            proc.kill()
            proc.wait()
            _assert_bit_identical(shm_store.get("g1"), shards["g1"])  # mapping outlives owner
            assert len(sweep_orphans(run_id)) == 4  # what the killed owner could not unlink
            _assert_bit_identical(shm_store.get("g1"), shards["g1"])
            shm_store.free(list(shards))
            # If the client saw the connection end before this pull, the pull connects afresh
            # and is refused (nothing listens); if during it, the connection closes: at once
            # either way, not after the client's timeout.
            gone = "'g0' on node 'rollout-7'.*(nothing listens|closed the connection)"
            with pytest.raises(OwnerLost, match=gone):
                await shm_client.pull(batch)
            await shm_client.close()
            shm_store.close()
        finally:
            ctx.destroy(linger=0)  # also closes sockets a failed assertion left open

    try:
        asyncio.run(main(addr))
    finally:
        _end(proc)
        sweep_orphans(run_id)


def test_owner_killed_mid_pull_fails_at_once_and_its_restart_serves_the_next_pull() -> None:
    run_id = _run_id()
    secret = new_secret()
    shards = make_shards(4)  # noqa: F821
    refs = [
        ShardRef("rollout-7", k, sum(t.nbytes for t in s.values()), 0) for k, s in shards.items()
    ]
    procs: list[subprocess.Popen] = []

    async def main() -> None:
        async with _tcp_client(run_id, secret) as (store, client):
            proc, addr = _start_owner(run_id, secret)
            procs.append(proc)
            batch = RTensor(refs, peers={"rollout-7": addr})
            await client.pull(batch)  # the connection is made
            store.free(list(shards))

            # Frozen, the owner cannot answer; killed, its kernel closes the connection.
            os.kill(proc.pid, signal.SIGSTOP)
            pending = asyncio.create_task(client.pull(batch))
            done, _ = await asyncio.wait([pending], timeout=0.5)
            assert not done  # its request waits for the frozen owner
            proc.kill()
            proc.wait()
            lost = f"'g0' on node 'rollout-7'.*owner at {re.escape(addr)} closed the connection"
            with pytest.raises(ShardUnavailable, match=lost) as e:
                # Far inside the client's 60 s timeout, which the pull used to wait out.
                await asyncio.wait_for(pending, 10.0)
            assert e.value.node == "rollout-7" and e.value.key == "g0"
            assert isinstance(e.value, OwnerLost)  # gone, not short of the key
            assert _held(store) == (0, 0)

            # Restarted at the same address, the owner serves the next pull (a new connection).
            proc, again = _start_owner(run_id, secret, port=int(addr.rpartition(":")[2]))
            procs.append(proc)
            assert again == addr
            got = await client.pull(batch)
            for ref, tensors in zip(refs, got, strict=True):
                _assert_bit_identical(tensors, shards[ref.key])
            store.free(list(shards))

    try:
        asyncio.run(main())
    finally:
        for proc in procs:
            _end(proc)
        sweep_orphans(run_id)


def test_owner_that_refuses_our_secret_fails_the_pull_at_once() -> None:
    async def main() -> None:
        run_id = _run_id()
        async with (
            _context() as (ctx, sec),
            _node(ctx, sec, "owner", run_id) as (owner, addr, _),
        ):
            owner.put("g0", make_shards(1)["g0"])  # noqa: F821
            mine = ShardStore(run_id, "stranger")
            client = DataPlaneClient(mine, ctx=ctx, security=Security(new_secret()), timeout=60.0)
            try:
                pull = client.pull_shards(_refs("owner", owner, ["g0"]), {"owner": addr})
                with pytest.raises(ShardUnavailable, match="'g0' on node 'owner'.*refused") as e:
                    await asyncio.wait_for(pull, 10.0)  # not the client's 60 s timeout
                assert "another run's secret?" in e.value.reason
                assert not isinstance(e.value, OwnerLost)  # a restart would meet the same refusal
                assert _held(mine) == (0, 0)
            finally:
                await client.close()
                mine.close()

    asyncio.run(main())


def test_a_reply_received_before_the_owner_died_completes_its_pull(monkeypatch) -> None:
    # A reader slower than the monitor, as a busy loop can make it: the monitor sees the
    # connection end while the owner's whole reply still waits in the DEALER.
    async def late_read(self: _Peer) -> None:
        while True:
            await asyncio.sleep(1.0)
            self._deliver(await self.sock.recv_multipart(copy=False))

    monkeypatch.setattr(_Peer, "_read", late_read)
    run_id = _run_id()
    secret = new_secret()
    shards = make_shards(4)  # noqa: F821
    small = ["g0", "g2", "g3"]  # one chunk in all: the whole reply fits the DEALER's queue
    refs = [ShardRef("rollout-7", k, 0, 0) for k in small]
    proc, addr = _start_owner(run_id, secret, 0, "exit-after-pull")

    async def main() -> None:
        async with _tcp_client(run_id, secret) as (store, client):
            got = await client.pull(RTensor(refs, peers={"rollout-7": addr}))
            for k, tensors in zip(small, got, strict=True):
                _assert_bit_identical(tensors, shards[k])
            assert await asyncio.to_thread(proc.wait) == 0  # it answered, then exited
            store.free(small)

    try:
        asyncio.run(main())
    finally:
        _end(proc)
        sweep_orphans(run_id)


def test_a_pull_to_an_owner_dead_before_the_pull_began_fails_at_once() -> None:
    """The owner dies between two pulls: the next pull is refused (or finds the old connection
    closing) and fails at once, far inside the client's 60 s timeout."""
    run_id = _run_id()
    secret = new_secret()
    shards = make_shards(4)  # noqa: F821
    refs = [
        ShardRef("rollout-7", k, sum(t.nbytes for t in s.values()), 0) for k, s in shards.items()
    ]

    async def main(proc: subprocess.Popen, addr: str) -> None:
        async with _tcp_client(run_id, secret) as (store, client):
            batch = RTensor(refs, peers={"rollout-7": addr})
            await client.pull(batch)
            store.free(list(shards))
            proc.kill()
            proc.wait()
            for _ in range(2):  # the first may meet the closing connection, the second is refused
                gone = "'g0' on node 'rollout-7'.*(nothing listens|closed the connection)"
                with pytest.raises(OwnerLost, match=gone):
                    await asyncio.wait_for(client.pull(batch), 10.0)
                assert _held(store) == (0, 0)

    proc, addr = _start_owner(run_id, secret)
    try:
        asyncio.run(main(proc, addr))
    finally:
        _end(proc)
        sweep_orphans(run_id)
