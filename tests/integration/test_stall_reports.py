"""A rollout that stops making progress says where it is stuck (issue 19, items 9 and 10).

- A reward that never returns: after ``rollout.stall_log_s`` the controller logs which groups
  are in flight, on which node, and for how long.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from arl.control.rollout import RolloutController
from arl.control.staleness import StalenessSemaphore
from arl.data.arith import make_arith
from arl.data.loader import StatefulLoader
from tests.support.cluster import local_cluster
from tests.support.tiny_model import make_tiny_model


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
    await worker.setup()
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
            finally:
                await rollout.stop()
            return node.node_id

    node_id = asyncio.run(main())
    lines = stall_lines()
    assert lines, "no stall line was logged"
    assert "(rollout.stall_log_s=1); 2 in flight: g0 on " + node_id + " for " in lines[0]
    assert f"g1 on {node_id} for " in lines[0]
