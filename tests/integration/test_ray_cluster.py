"""arl nodes placed by a real Ray cluster: a head started here with `ray start --head` (CPU only).

The module's fixture starts its own head node on free ports in a private temp dir and ends it
afterwards, so these tests run from plain pytest; they skip only when ``ray`` is not installed
(``pip install -e '.[ray]'``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import attrs
import pytest
import uvloop

from arl.config import ConfigError
from arl.control.controller import Controller, NodeLost
from arl.control.ray_launcher import RayNodes
from arl.process import death_signal_argv
from arl.protocol.plan import NodeSpec
from arl.protocol.proxy import proxy
from arl.stats.logger import read_jsonl
from arl.wire.sockets import Security, new_secret
from tests.support.objects import Echo
from tests.support.tiny_model import make_tiny_model, tiny_run_config

ray = pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]'")

REPO = Path(__file__).resolve().parents[2]
HB = dict(heartbeat_interval=0.3, heartbeat_timeout=5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def ray_head():
    """The address of a one-node Ray cluster on this host (4 logical CPUs, no GPU)."""
    ray_cli = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    temp = tempfile.mkdtemp(prefix="arlray-", dir="/tmp")  # short: Ray's socket paths live here
    port = _free_port()
    cmd = [
        ray_cli,
        "start",
        "--head",
        "--block",
        f"--port={port}",
        "--num-cpus=4",
        "--num-gpus=0",
        "--disable-usage-stats",
        "--include-dashboard=false",
        f"--dashboard-port={_free_port()}",
        f"--dashboard-agent-listen-port={_free_port()}",
        f"--ray-client-server-port={_free_port()}",
        f"--temp-dir={temp}",
    ]
    with pytest.MonkeyPatch.context() as mp, open(Path(temp) / "ray-start.log", "w") as log:
        # Ray 2.5x turns token auth on when it finds ~/.ray/auth_token (a `ray.init()` local
        # cluster writes one); this private head and the test's drivers say: no token.
        mp.setenv("RAY_AUTH_MODE", "disabled")
        proc = subprocess.Popen(  # it ends when pytest dies, too (SIGTERM by PDEATHSIG)
            death_signal_argv(cmd),
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 120
            while not (Path(temp) / "ray_current_cluster").exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("`ray start --head` failed:\n" + Path(log.name).read_text()[-3000:])
                time.sleep(0.2)
            yield f"127.0.0.1:{port}"
        finally:
            proc.send_signal(signal.SIGTERM)  # `ray start --block` drains and ends its processes
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def ray_driver(ray_head):
    """This test process connected to the head as a Ray driver (RayNodes then reuses it)."""
    with _connected(ray_head, namespace="arl-test"):
        yield ray


@contextmanager
def _connected(address: str, **kw):
    # ray.init on the main thread makes SIGTERM raise SystemExit; give pytest its own back.
    sigterm = signal.getsignal(signal.SIGTERM)
    ray.init(address=address, **kw)
    try:
        yield
    finally:
        ray.shutdown()
        signal.signal(signal.SIGTERM, sigterm)


def _cpu_plan() -> list[NodeSpec]:
    common = dict(device="cpu", tp_size=1)
    return [
        NodeSpec(node_id=0, role="rollout", rank=0, engine="hf", dp_rank=0, **common),
        NodeSpec(node_id=1, role="train", rank=0, engine="fsdp", dp_rank=0, **common),
    ]


def _ray_nodes(security: Security, address: str) -> RayNodes:
    return RayNodes(
        security,
        _cpu_plan(),
        node_ids=["rollout0", "train0"],
        address=address,
        namespace="arl-test",
        allowed_prefixes=("arl.", "tests."),
        **HB,
    )


def _assert_nothing_left(seen: dict) -> None:
    """The daemons, the actors and the placement group of a finished block are all gone."""
    assert not [p for p in seen["pids"] if _alive(p)], "an arl-node outlived the block"
    for name in seen["names"]:
        with pytest.raises(ValueError):
            ray.get_actor(name, namespace="arl-test")
    assert ray.util.placement_group_table(seen["pg"])["state"] == "REMOVED"
    assert ray.is_initialized()  # the connection was the test's: RayNodes left it open


def _remember(nodes: RayNodes, seen: dict) -> None:
    seen["pg"] = nodes._pg
    seen["pids"] = [i["pid"] for i in nodes.infos.values()]
    seen["names"] = [nodes.actor_name(n) for n in nodes.infos]


def test_ray_actors_run_the_nodes_and_nothing_is_left(ray_driver, ray_head):
    security = Security(new_secret())
    seen: dict = {}

    async def main():
        async with _ray_nodes(security, ray_head) as nodes:
            # Every Ray node is this host, so the controller stays on loopback.
            host = nodes.controller_host("127.0.0.1")
            assert host == "127.0.0.1"
            async with Controller(security, host=host, **HB) as ctl:
                await nodes.start(ctl.address)
                _remember(nodes, seen)
                handles = await ctl.wait_for_nodes(2, timeout=120)
                assert sorted(h.node_id for h in handles) == ["rollout0", "train0"]
                for h in handles:
                    echo = proxy(Echo, await h.create("tests.support.objects:Echo"))
                    assert await echo.echo({"x": [1, 2]}) == {"x": [1, 2]}
                    # The node that answers is the daemon its Ray actor started.
                    pid = await echo.pid()
                    assert pid == nodes.infos[h.node_id]["pid"]
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                    assert b"-m\0arl.node\0" in cmdline
                    assert security.secret.encode() not in cmdline  # the secret is in its env
                    assert ray.get_actor(nodes.actor_name(h.node_id), namespace="arl-test")
                # Each node reserved its role's CPUs through the placement group.
                table = ray.util.placement_group_table(nodes._pg)
                assert table["state"] == "CREATED"
                assert table["bundles"] == {0: {"CPU": 1.0}, 1: {"CPU": 1.0}}

    asyncio.run(main())
    _assert_nothing_left(seen)


def test_killed_actor_is_node_lost_naming_it_and_ctrl_c_ends_the_rest(ray_driver, ray_head):
    security = Security(new_secret())
    seen: dict = {}

    async def main():
        async with _ray_nodes(security, ray_head) as nodes:
            async with Controller(security, **HB) as ctl:
                await nodes.start(ctl.address)
                _remember(nodes, seen)
                handles = {h.node_id: h for h in await ctl.wait_for_nodes(2, timeout=120)}
                slow = proxy(Echo, await handles["rollout0"].create("tests.support.objects:Echo"))
                call = asyncio.create_task(slow.block(120))
                await asyncio.sleep(0.2)
                ray.kill(nodes.actors["rollout0"])
                with pytest.raises(NodeLost, match="node rollout0 was lost while running Echo"):
                    await asyncio.wait_for(call, 60)
                # Its daemon died with the actor; the other node carries on.
                pid = nodes.infos["rollout0"]["pid"]
                deadline = time.monotonic() + 30
                while _alive(pid) and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                assert not _alive(pid), "the daemon outlived its killed actor"
                other = proxy(Echo, await handles["train0"].create("tests.support.objects:Echo"))
                assert await other.echo(7) == 7
                assert "rollout0" in ctl.lost and "train0" not in ctl.lost
                # Ctrl-C: asyncio.run cancels main(), then raises KeyboardInterrupt.
                signal.raise_signal(signal.SIGINT)
                await asyncio.sleep(60)

    # Ctrl-C as it reaches a program in the foreground: a test process started as a background
    # job inherits SIGINT ignored, and asyncio.run installs its handler only over Python's own.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            asyncio.run(main())
    finally:
        signal.signal(signal.SIGINT, previous)
    _assert_nothing_left(seen)


def test_plans_the_cluster_cannot_hold_fail_saying_what_is_missing(ray_driver, ray_head):
    security = Security(new_secret())
    gpu_plan = [
        attrs.evolve(n, gpu_ids=(i,), device=f"cuda:{i}") for i, n in enumerate(_cpu_plan())
    ]

    async def enter(nodes: RayNodes):
        async with nodes:
            pass

    kw = dict(node_ids=["rollout0", "train0"], address=ray_head, namespace="arl-test")
    with pytest.raises(ConfigError, match="needs 2 GPUs but the Ray cluster has 0"):
        asyncio.run(enter(RayNodes(security, gpu_plan, **kw)))
    too_big = RayNodes(security, _cpu_plan(), cpus={"rollout": 64}, placement_timeout=2, **kw)
    with pytest.raises(
        RuntimeError, match=r"did not reserve .* the cluster has CPU 4, GPU 0, free now CPU 4"
    ):
        asyncio.run(enter(too_big))
    assert ray.util.placement_group_table() == {} or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()
    )


def test_ray_address_without_a_cluster_is_a_clear_error():
    """Ray itself would retry a missing head for minutes; the launcher says what is wrong."""
    security = Security(new_secret())
    port = _free_port()  # nothing listens there

    async def main():
        async with _ray_nodes(security, f"127.0.0.1:{port}"):
            pass

    with pytest.raises(ConfigError, match=rf"ray_address='127.0.0.1:{port}': no Ray head answers"):
        asyncio.run(main())
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def test_tiny_run_with_nodes_placed_by_ray(tmp_path, tiny_model, ray_head, caplog):
    """The tiny end-to-end recipe (3 GRPO steps, weight sync checked) with cluster.launcher=ray:
    Ray starts the nodes, arl's own sockets carry everything, nothing is left afterwards."""
    from arl.run import run

    cfg = tiny_run_config(
        tmp_path,
        tiny_model,
        "cluster.launcher=ray",
        f"cluster.ray_address={ray_head}",
        "cluster.ray_namespace=arl-e2e",
        "saver.hf_export=false",
    )
    with caplog.at_level(logging.INFO, logger="arl.ray"):
        uvloop.run(run(cfg))  # the loop `python -m arl.launch` runs it on
    rows = read_jsonl(cfg.run_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["sync/checksum_match"] is True for r in rows)
    assert len({r["sync/checksum"] for r in rows}) == 3
    placed = re.findall(r"node (\w+): Ray actor on .* daemon pid (\d+)", caplog.text)
    assert sorted(n for n, _ in placed) == ["rollout0", "train0"], caplog.text[-2000:]
    assert not [p for _, p in placed if _alive(int(p))], "an arl-node outlived the run"
    assert not ray.is_initialized()  # the run connected to Ray itself, and disconnected
    with _connected(ray_head):
        left = ray.util.list_named_actors(all_namespaces=True)
        assert not [a for a in left if a["namespace"] == "arl-e2e"], left
