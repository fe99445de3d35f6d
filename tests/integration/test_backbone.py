"""The control plane on real `arl-node` processes over real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import pytest
import torch

from arl.control.controller import NodeLost
from arl.protocol.errors import RemoteError
from arl.protocol.proxy import proxy
from tests.support.cluster import local_cluster
from tests.support.objects import Echo

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((str(dtype), shape)) % 2**31)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 1e3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(
        max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=g, dtype=torch.int64
    ).to(dtype)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def test_tensors_of_every_dtype_round_trip_bit_exact():
    async def main():
        async with local_cluster(1) as (_, nodes, _procs):
            echo = proxy(Echo, await nodes[0].create("tests.support.objects:Echo"))
            for dtype in DTYPES:
                for shape in [(), (0,), (3, 0, 2), (7,), (64, 33), (2, 3, 4, 5)]:
                    t = _sample(dtype, shape)
                    back = await echo.echo({"t": t, "nested": [t, {"x": t}]})
                    for got in (back["t"], back["nested"][0], back["nested"][1]["x"]):
                        assert got.dtype == dtype and tuple(got.shape) == shape
                        assert _bits(got) == _bits(t), (dtype, shape)
            # A non-contiguous view travels as its logical values.
            base = torch.arange(200, dtype=torch.float32).reshape(10, 20)
            view = base[:, ::3].t()
            assert torch.equal(await echo.echo(view), view)

    asyncio.run(main())


def test_thousand_concurrent_calls_on_one_socket_complete():
    async def main():
        async with local_cluster(2) as (_, nodes, _procs):
            objs = [proxy(Echo, await n.create("tests.support.objects:Echo")) for n in nodes]
            calls = [objs[i % 2].aecho({"i": i}, 0.001 * (i % 7)) for i in range(1000)]
            results = await asyncio.gather(*calls)
            assert [r["i"] for r in results] == list(range(1000))

    asyncio.run(main())


def test_remote_exception_surfaces_with_type_and_traceback():
    async def main():
        async with local_cluster(1) as (_, nodes, _procs):
            echo = proxy(Echo, await nodes[0].create("tests.support.objects:Echo"))
            with pytest.raises(RemoteError) as info:
                await echo.fail("the answer is not 42")
            err = info.value
            assert err.type_name == "ValueError"
            assert "the answer is not 42" in str(err)
            assert "objects.py" in err.remote_traceback and "in fail" in err.remote_traceback
            # The node keeps serving after an error.
            assert await echo.echo(5) == 5

    asyncio.run(main())


def test_imports_outside_allowed_prefixes_are_refused_before_import():
    async def main():
        async with local_cluster(1, allow=("arl.",)) as (_, nodes, _procs):
            with pytest.raises(RemoteError) as info:
                await nodes[0].create("tests.support.objects:Echo")
            assert info.value.type_name == "ImportRefused"
            assert "allowed" in str(info.value)
            with pytest.raises(RemoteError):
                await nodes[0].create("os:system", "true")

    asyncio.run(main())


def test_kill_9_of_a_node_gives_node_lost_within_timeout():
    async def main():
        async with local_cluster(2, heartbeat_interval=0.2, heartbeat_timeout=2.0) as (
            ctl,
            nodes,
            _procs,
        ):
            victim = nodes[0]
            echo = proxy(Echo, await victim.create("tests.support.objects:Echo"))
            pending = asyncio.create_task(echo.block(60))
            await asyncio.sleep(0.3)
            os.kill(victim.info["pid"], signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(NodeLost) as info:
                await asyncio.wait_for(pending, 20)
            assert victim.node_id in str(info.value) and "block" in str(info.value)
            assert time.monotonic() - t0 < 20
            assert victim.node_id in ctl.lost
            # The other node still answers; a new call to the lost one fails at once.
            other = proxy(Echo, await nodes[1].create("tests.support.objects:Echo"))
            assert await other.echo(1) == 1
            with pytest.raises(NodeLost, match=r"while running \S+\.echo: "):
                await echo.echo(1)

    asyncio.run(main())


def test_a_call_to_a_node_whose_connection_is_gone_names_the_call():
    """Before the heartbeats declare it lost, a killed node's connection is already gone: a call
    then fails at once ("not connected"), naming the object method, not the wire op."""

    async def main() -> str:
        async with local_cluster(1, heartbeat_interval=0.2, heartbeat_timeout=120) as (
            ctl,
            (victim,),
            _procs,
        ):
            echo = proxy(Echo, await victim.create("tests.support.objects:Echo"))
            os.kill(victim.info["pid"], signal.SIGKILL)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:  # queued while libzmq still holds the connection; refused once it is gone
                    await asyncio.wait_for(echo.echo(1), 1.0)
                except TimeoutError:
                    continue
                except NodeLost as e:
                    assert victim.node_id not in ctl.lost  # the heartbeats have not decided
                    return str(e)
            raise AssertionError("calls to the killed node never failed")

    message = asyncio.run(main())
    assert re.search(r"was lost while running \S+\.echo: not connected", message), message


def test_node_exits_when_controller_is_gone(tmp_path):
    """A node whose controller vanishes without a bye stops by itself (no orphans)."""
    import subprocess
    import sys

    script = tmp_path / "ctl.py"
    pidfile = tmp_path / "pids"
    script.write_text(
        "import asyncio, sys\n"
        f"sys.path.insert(0, {os.getcwd()!r})\n"
        "from tests.support.cluster import local_cluster\n"
        "async def main():\n"
        "    async with local_cluster(2, heartbeat_interval=0.2, heartbeat_timeout=2.0)"
        " as (c, n, p):\n"
        f"        open({str(pidfile)!r}, 'w').write(' '.join(map(str, p.pids)))\n"
        "        await asyncio.sleep(600)\n"
        "asyncio.run(main())\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)])
    try:
        deadline = time.monotonic() + 90
        while not pidfile.exists() or not pidfile.read_text():
            assert time.monotonic() < deadline, "cluster did not start"
            assert proc.poll() is None, "launcher died"
            time.sleep(0.2)
        pids = [int(p) for p in pidfile.read_text().split()]
        proc.kill()  # the launcher dies without cleaning up
        proc.wait()
        deadline = time.monotonic() + 15
        alive = pids
        while alive and time.monotonic() < deadline:
            time.sleep(0.2)
            alive = [p for p in pids if _alive(p)]
        assert not alive, f"node processes {alive} outlived the launcher"
    finally:
        proc.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; only its parent's wait is missing.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_two_controllers_in_one_loop_do_not_share_state():
    async def main():
        async with local_cluster(1) as (ctl_a, nodes_a, _), local_cluster(1) as (ctl_b, nodes_b, _):
            assert ctl_a.address != ctl_b.address
            assert ctl_a.security.secret != ctl_b.security.secret
            a = proxy(Echo, await nodes_a[0].create("tests.support.objects:Echo", "a"))
            b = proxy(Echo, await nodes_b[0].create("tests.support.objects:Echo", "b"))
            assert await asyncio.gather(a.pid(), b.pid()) == [
                nodes_a[0].info["pid"],
                nodes_b[0].info["pid"],
            ]
            assert len(ctl_a.live_nodes()) == len(ctl_b.live_nodes()) == 1

    asyncio.run(main())


def test_stopped_node_sigstop_is_lost_within_timeout():
    """A node whose heartbeats stop (SIGSTOP: alive but silent) is declared lost."""

    async def main():
        async with local_cluster(1, heartbeat_interval=0.2, heartbeat_timeout=2.0) as (
            ctl,
            nodes,
            _procs,
        ):
            node = nodes[0]
            echo = proxy(Echo, await node.create("tests.support.objects:Echo"))
            os.kill(node.info["pid"], signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                with pytest.raises(NodeLost) as info:
                    await asyncio.wait_for(echo.echo(1), 20)
                assert "no heartbeat" in str(info.value) and node.node_id in str(info.value)
                assert time.monotonic() - t0 < 20
            finally:
                os.kill(node.info["pid"], signal.SIGCONT)

    asyncio.run(main())
