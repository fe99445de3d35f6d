"""A slow node: it answers heartbeats, but a call takes far longer than its deadline.

- Training calls run within ``actor.call_timeout`` (`arl.control.workers.call_all`): past it
  the run stops with `CallTimeout` naming the node and the call, instead of waiting forever.
- A prompt group runs within ``rollout.group_timeout`` on its node: past it the group is
  cancelled there (nothing is stored), counted in ``rollout/timed_out``, and rollout goes on
  (AReaL's per-request timeout plays the same part).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from arl.control.rollout import RolloutController
from arl.control.staleness import StalenessSemaphore
from arl.control.workers import CallTimeout, call_all
from arl.data.arith import make_arith
from arl.data.loader import StatefulLoader
from arl.node.rollout import data_id
from arl.protocol.errors import RemoteError
from arl.protocol.remote import rollout_worker
from tests.support.cluster import local_cluster
from tests.support.tiny_model import make_tiny_model

BLOCK_S = 20.0  # how long the slow call would take; every deadline below is far shorter


def test_a_call_past_its_deadline_stops_naming_the_slow_node_and_call():
    async def main():
        async with local_cluster(2, heartbeat_interval=0.2, heartbeat_timeout=5) as (
            ctl,
            nodes,
            _,
        ):
            workers = [await n.create("tests.support.objects:Echo", name="train") for n in nodes]
            t0 = time.monotonic()
            with pytest.raises(CallTimeout) as info:
                # the first node is stuck in its call, the second answers at once
                await call_all(workers, "block", [[BLOCK_S], [0.01]], timeout=1.0)
            waited = time.monotonic() - t0
            # The slow node was never declared lost: it kept answering heartbeats.
            lost = dict(ctl.lost)
            return info.value, waited, lost, nodes[0].node_id

    err, waited, lost, slow = asyncio.run(main())
    assert err.nodes == [slow] and err.call == "train.block"
    assert str(err).startswith(f"train.block on node {slow} ran longer than actor.call_timeout=1s")
    assert "slow or stuck" in str(err)
    assert waited < BLOCK_S  # it did not wait for the stuck call
    assert lost == {}


def test_a_failed_rank_is_raised_at_once_while_another_is_stuck():
    async def main():
        async with local_cluster(2, heartbeat_interval=0.2, heartbeat_timeout=5) as (_, nodes, _p):
            workers = [await n.create("tests.support.objects:Echo", name="train") for n in nodes]
            t0 = time.monotonic()
            with pytest.raises(RemoteError) as info:
                # the second node's call fails (time.sleep of a string); the first would block
                # for BLOCK_S, like a rank waiting in a collective for the failed one
                await call_all(workers, "block", [[BLOCK_S], ["not a number"]], timeout=None)
            return info.value, time.monotonic() - t0, nodes[1].node_id

    err, waited, failing = asyncio.run(main())
    assert err.node == failing and err.type_name == "TypeError"
    assert waited < BLOCK_S


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def test_a_group_past_rollout_group_timeout_is_abandoned_and_counted(tiny_model):
    rows = make_arith(4, seed=0, split="train")
    rows[1] = {**rows[1], "slow": 600}  # stuck far past the deadline

    async def main():
        async with local_cluster(1, heartbeat_interval=0.3, heartbeat_timeout=30) as (
            _,
            (node,),
            _p,
        ):
            worker = await node.create(
                "arl.node.rollout:RolloutWorker",
                name="rollout",
                model_path=tiny_model,
                workflow="tests.support.objects:SlowWorkflow",
                reward="arl.rewards.arith:arith_reward",
                sampling={"max_new_tokens": 4},
                n_samples=2,
                max_prompt_len=128,
                group_timeout=3.0,
            )
            await rollout_worker(worker).setup()

            async def free(refs):
                await node.call("free", {"keys": [r.key for r in refs]})

            rollout = RolloutController(
                [worker],
                StatefulLoader(rows, 1, shuffle=False),
                StalenessSemaphore(3, 0, 3),
                peers={node.node_id: node.info["data_addr"]},
                free=free,
            )
            rollout.start()
            try:
                batch, infos = await asyncio.wait_for(rollout.prepare_batch(3, 0), 120)
            finally:
                await rollout.stop()
            held = (await node.call("ping"))["n_shards"]
            await free(list(batch.refs))
            return batch, infos, rollout.stats, held

    batch, infos, stats, held = asyncio.run(main())
    # The batch is the three prompt groups that finished (in the order they did); the stuck
    # one was cancelled on its node (no shard stored for it) and counted.
    taken = sorted(zip((r.key for r in batch.refs), (i.data_id for i in infos), strict=True))
    assert taken == [(f"g{i}", data_id(rows[i])) for i in (0, 2, 3)]
    assert (stats.timed_out, stats.failed, stats.accepted) == (1, 1, 3)
    assert held == 3
