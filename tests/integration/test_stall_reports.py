"""A rollout that stops making progress says where it is stuck (issue 19, items 9 and 10).

- A reward that never returns: after ``rollout.stall_log_s`` the controller logs which groups
  are in flight, on which node, and for how long.
- A reward that blocks its node's event loop (``time.sleep`` inside ``async def``): the node's
  watchdog reports the blocking line before the heartbeat timeout, the run stops naming it
  rather than "no heartbeat", and recovery does not restart it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arl.control.controller import NodeLost
from arl.control.rollout import RolloutController, RolloutFailed
from arl.control.staleness import StalenessSemaphore
from arl.data.arith import make_arith
from arl.data.loader import StatefulLoader
from arl.protocol.remote import rollout_worker
from arl.supervisor import recoverable
from tests.support import hostile
from tests.support.cluster import local_cluster
from tests.support.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
HOSTILE = Path(hostile.__file__).resolve()
BLOCK_LINE = next(
    i for i, line in enumerate(HOSTILE.read_text().splitlines(), 1) if "time.sleep(" in line
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


async def _rollout_worker(node, model: str, reward: str):
    worker = await node.create(
        "arl.node.rollout:RolloutWorker",
        name="rollout",
        model_path=model,
        reward=reward,
        sampling={"max_new_tokens": 4},
        n_samples=2,
        max_prompt_len=128,
    )
    await rollout_worker(worker).setup()
    return worker


def _controller(worker, node, rows, **kwargs) -> RolloutController:
    return RolloutController(
        [worker],
        StatefulLoader(rows, 1, shuffle=False),
        StalenessSemaphore(2, 0, 2),
        peers={node.node_id: node.info["data_addr"]},
        free=lambda refs: asyncio.sleep(0),
        **kwargs,
    )


def test_a_reward_that_never_returns_is_logged_with_its_groups_and_node(tiny_model, caplog):
    caplog.set_level(logging.WARNING, logger="arl.rollout")
    rows = make_arith(4, seed=0, split="train")

    def stall_lines() -> list[str]:
        messages = [r.getMessage() for r in caplog.records]
        return [m for m in messages if "no prompt group finished" in m]

    async def main():
        async with local_cluster(1, heartbeat_timeout=30) as (_, (node,), _p):
            worker = await _rollout_worker(node, tiny_model, "tests.support.hostile:endless_reward")
            rollout = _controller(worker, node, rows, stall_log_s=1.0)
            rollout.start()
            try:
                deadline = time.monotonic() + 120
                while not stall_lines() and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                # While every engine is held for a train phase (asleep, under
                # rollout.gpu_sharing=sleep) no group can finish, by design: no stall line then,
                # and the stuck groups are reported again stall_log_s after the release.
                logged = len(stall_lines())
                async with rollout.held([0]):
                    await asyncio.sleep(2.5)
                    held = stall_lines()[logged:]
                deadline = time.monotonic() + 60
                while len(stall_lines()) == logged and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
            finally:
                await rollout.stop()
            return node.node_id, held, logged

    node_id, held, logged = asyncio.run(main())
    lines = stall_lines()
    assert lines, "no stall line was logged"
    assert held == [], held
    assert len(lines) > logged, "the groups still stuck after the release were not reported"
    assert "(rollout.stall_log_s=1); 2 in flight: g0 on " + node_id + " for " in lines[0]
    assert f"g1 on {node_id} for " in lines[0]


def test_a_reward_blocking_the_event_loop_is_named_and_not_recoverable(tiny_model, caplog):
    caplog.set_level(logging.WARNING, logger="arl.controller")
    rows = [{**r, "block_s": 60} for r in make_arith(2, seed=0, split="train")]

    async def main():
        # The timeout is far below the reward's 60 s block, and far above a start-up stall of
        # a loaded machine (a node imports its role's modules with the GIL held).
        async with local_cluster(1, heartbeat_interval=0.3, heartbeat_timeout=12) as (
            _,
            (node,),
            _p,
        ):
            worker = await _rollout_worker(
                node, tiny_model, "tests.support.hostile:blocking_reward"
            )
            rollout = _controller(worker, node, rows)
            rollout.start()
            try:
                with pytest.raises(RolloutFailed) as info:
                    await asyncio.wait_for(rollout.prepare_batch(1, 0), 120)
            finally:
                await rollout.stop()
            return info.value, node.node_id

    err, node_id = asyncio.run(main())
    lost = err.__cause__
    assert isinstance(lost, NodeLost), err
    where = f"blocking_reward at {HOSTILE}:{BLOCK_LINE}"
    assert lost.blocked_in.startswith(where), lost.blocked_in
    assert str(lost).startswith(
        f"node {node_id} was lost while running rollout.run_group: its event loop is blocked "
        f"in {where}"
    ), lost
    assert "asyncio.to_thread" in str(lost)
    assert not recoverable(err)
    reports = [r for r in caplog.records if "its event loop has been blocked" in r.getMessage()]
    assert reports and reports[0].levelno == logging.WARNING


def test_the_launcher_does_not_restart_a_blocked_loop(tmp_path, tiny_model):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "arl.launch",
            "recipes/arith.py",
            f"experiment.run_dir={tmp_path / 'runs'}",
            f"actor.path={tiny_model}",
            "actor.dtype=float32",
            "data.batch_size=1",
            "gconfig.n_samples=2",
            "gconfig.max_new_tokens=4",
            "data.max_prompt_len=128",
            "actor.max_tokens_per_mb=512",
            "cluster.n_gpus=0",
            "cluster.heartbeat_interval=0.3",
            "cluster.heartbeat_timeout=12",  # below the reward's 30 s block (see above)
            "cluster.allowed_import_prefixes=[arl,tests]",
            "rollout.reward=tests.support.hostile:blocking_reward",
            "recover.mode=auto",
            "stats.progress_bar=false",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 1, res.stderr[-3000:]
    assert f"its event loop is blocked in blocking_reward at {HOSTILE}:{BLOCK_LINE}" in res.stderr
    assert "recovery: not restarting" in res.stderr
    assert "restarting the run" not in res.stderr
