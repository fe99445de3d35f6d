"""Replies are bound to the node that was called (issue 19, item 2).

A peer holding the run secret says hello as a node of its own and then sends ``ok`` and ``err``
replies for every call id it can guess. The controller refuses each (logged at WARNING, counted
in ``misrouted``) and the real node's answers complete the calls. A reply of the wrong shape from
the called node itself stops rollout with `BadReply` naming the node and what was wrong.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import zmq

from arl.control.controller import BadReply
from arl.control.rollout import RolloutController, RolloutFailed
from arl.control.staleness import StalenessSemaphore
from arl.data.arith import make_arith
from arl.data.loader import StatefulLoader
from arl.protocol.proxy import proxy
from arl.protocol.remote import rollout_worker
from arl.wire.codec import Message, decode_message, encode_message
from arl.wire.sockets import make_socket
from tests.support.cluster import local_cluster
from tests.support.objects import Echo
from tests.support.tiny_model import make_tiny_model

N_FORGED = 3000


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


async def _forger(ctl, n: int) -> int:
    """Join ``ctl`` as node 'forger' with the run secret; forge ok/err replies for ids 1..n."""
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER, ctl.security, server=False)
    sock.setsockopt(zmq.ROUTING_ID, b"forger")
    sock.connect(ctl.address)
    try:
        await sock.send_multipart(encode_message(Message("hello", 1, "hello", {"node_id": "f"})))
        reply = decode_message(await asyncio.wait_for(sock.recv_multipart(copy=False), 30))
        assert reply.op == "ok", reply
        for mid in range(1, n + 1):
            op, args = ("ok", None) if mid % 2 else ("err", {"type": "X", "message": "forged"})
            await sock.send_multipart(encode_message(Message(op, mid, "", args)))
        await asyncio.sleep(0.5)  # let the controller read them before the link closes
        return n
    finally:
        sock.close(0)
        ctx.term()


def test_forged_replies_from_another_node_are_refused_and_the_real_answer_wins(caplog):
    caplog.set_level(logging.WARNING, logger="arl.controller")

    async def main():
        async with local_cluster(1) as (ctl, (node,), _p):
            echo = proxy(Echo, await node.create("tests.support.objects:Echo"))
            calls = [asyncio.create_task(echo.aecho(f"real{i}", delay=3.0)) for i in range(8)]
            await asyncio.sleep(0.5)  # the calls are in flight on the real node
            await _forger(ctl, N_FORGED)
            results = await asyncio.gather(*calls)
            return results, ctl.misrouted, node.node_id

    results, misrouted, real = asyncio.run(main())
    assert results == [f"real{i}" for i in range(8)]
    assert misrouted >= 8  # at least one forged reply per pending call was refused
    refused = [r for r in caplog.records if "but that call went to node" in r.getMessage()]
    assert refused and all(r.levelno == logging.WARNING for r in refused)
    assert f"came from node f, but that call went to node {real}" in refused[0].getMessage()


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (None, "GroupReport: expected a map, got None"),
        ({"key": "g0"}, "'group_size' must be an integer"),
        (
            {
                "key": "g0",
                "meta": {"key": "g0"},
                "group_size": 2,
                "n_gen_tokens": 1,
                "min_version": 0,
                "rewards": [0.0, 1.0],
                "data_id": "x",
            },
            "'meta': ShardRef: 'nbytes' must be an integer",
        ),
    ],
)
def test_a_reply_of_the_wrong_shape_stops_rollout_naming_the_node(answer, why):
    rows = make_arith(4, seed=0, split="train")

    async def main():
        async with local_cluster(1) as (_, (node,), _p):
            worker = await node.create("tests.support.hostile:WrongShapeWorker", answer)
            rollout = RolloutController(
                [worker],
                StatefulLoader(rows, 1, shuffle=False),
                StalenessSemaphore(1, 0, 1),
                peers={node.node_id: node.info["data_addr"]},
                free=lambda refs: asyncio.sleep(0),
            )
            rollout.start()
            try:
                with pytest.raises(RolloutFailed) as info:
                    await asyncio.wait_for(rollout.prepare_batch(1, 0), 60)
            finally:
                await rollout.stop()
            return info.value, rollout.stats, node.node_id

    err, stats, node_id = asyncio.run(main())
    assert isinstance(err.__cause__, BadReply)
    assert str(err).startswith(f"node {node_id} answered rollout.run_group('g0') with an unex")
    assert why in str(err)
    assert stats.bad_replies == 1


def test_rollout_groups_survive_a_forger_and_every_shard_is_freed(tiny_model):
    """The issue's case: forged ``ok`` replies used to complete a pending run_group of the rollout
    node, whose group was then dropped and its shard never freed."""
    rows = make_arith(4, seed=0, split="train")

    async def main():
        async with local_cluster(1, heartbeat_timeout=30) as (ctl, (node,), _p):
            worker = await node.create(
                "arl.node.rollout:RolloutWorker",
                name="rollout",
                model_path=tiny_model,
                reward="arl.rewards.arith:arith_reward",
                sampling={"max_new_tokens": 8},
                n_samples=2,
                max_prompt_len=128,
            )
            await rollout_worker(worker).setup()

            async def free(refs):
                await node.call("free", {"keys": [r.key for r in refs]})

            rollout = RolloutController(
                [worker],
                StatefulLoader(rows, 1, shuffle=False),
                StalenessSemaphore(4, 0, 4),
                peers={node.node_id: node.info["data_addr"]},
                free=free,
            )
            rollout.start()
            try:
                forger = asyncio.create_task(_forger(ctl, N_FORGED))
                batch, infos = await asyncio.wait_for(rollout.prepare_batch(4, 0), 120)
                await forger
            finally:
                await rollout.stop()
            held = (await node.call("ping"))["n_shards"]
            await free(list(batch.refs))
            left = (await node.call("ping"))["n_shards"]
            return batch, infos, rollout.stats, held, left, ctl.misrouted

    batch, infos, stats, held, left, misrouted = asyncio.run(main())
    assert sorted(r.key for r in batch.refs) == ["g0", "g1", "g2", "g3"]  # as they finished
    assert all(len(i.rewards) == 2 for i in infos)
    assert (stats.accepted, stats.failed, stats.bad_replies) == (4, 0, 0)
    assert misrouted > 0
    assert (held, left) == (4, 0)
