"""A node a job script started with default flags (``cluster.launcher=attach``) runs with the
run's settings, which the controller's hello reply hands it: the run's import prefixes let it
create a recipe's own object, and the run's ``cluster.heartbeat_timeout`` ends it when the
controller falls silent."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from arl.config import Config, apply_overrides
from arl.control.cluster import start_cluster
from arl.control.launcher import _spawn_watched
from arl.protocol.plan import NodeSpec, Plan
from arl.wire.addresses import free_port
from arl.wire.sockets import SECRET_ENV, new_secret

REPO = Path(__file__).resolve().parents[2]


def test_an_attached_node_with_default_flags_takes_the_runs_prefixes_and_heartbeat_timeout(
    monkeypatch, tmp_path
):
    secret = new_secret()
    monkeypatch.setenv(SECRET_ENV, secret)  # the run's side: read by run_security
    port = free_port("127.0.0.1")
    cfg = apply_overrides(
        Config(),
        [
            "cluster.launcher=attach",
            f"cluster.controller_port={port}",
            "cluster.heartbeat_interval=0.2",
            "cluster.heartbeat_timeout=2.0",  # the node's default flag says 10
            "cluster.allowed_import_prefixes=[arl.,tests.]",  # the default flag says arl. alone
            f"experiment.run_dir={tmp_path}",
        ],
    )
    node = NodeSpec(
        node_id=0, role="rollout", rank=0, device="cpu", engine="hf", dp_rank=0, tp_size=1
    )
    plan = Plan(nodes=[node], sync_mode="zmq")
    # What a job script runs: no flag but the address. INFO logs (by the environment, not a
    # flag) show why the node stopped.
    cmd = [sys.executable, "-m", "arl.node.daemon", "--controller", f"tcp://127.0.0.1:{port}"]
    env = {
        **os.environ,
        SECRET_ENV: secret,
        "ARL_LOG_LEVEL": "INFO",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }

    async def main() -> str:
        proc, tail = _spawn_watched(cmd, env, "attached")
        try:
            async with start_cluster(cfg, plan) as cluster:
                node = cluster.rollout[0].handle
                echo = await node.create("tests.support.objects:Echo")
                assert await echo.call("echo", 7) == 7
                # The controller falls silent (its loop blocked): past the run's 2 s, well
                # inside the default 10 s, the node ends itself.
                time.sleep(5.0)
                assert await asyncio.wait_for(proc.wait(), 60) == 1  # it lost its controller
        finally:
            await proc.stop(5.0)
        return "\n".join(tail.last_lines(50))

    stderr = asyncio.run(main())
    assert "stopping: controller silent for more than 2.0s" in stderr, stderr
