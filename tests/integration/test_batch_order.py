"""Which finished groups a batch takes (``rollout.batch_order``), and what a resumed run submits.

One real rollout node; group g0's episode first sleeps (`tests.support.objects.SlowWorkflow`),
so later groups finish before it. ``finished`` takes them without waiting for g0, until the
batch that is g0's last within eta, which waits for it (also where several groups are due
together, eta = 2); ``submitted`` takes g0 first.
A checkpoint taken after an out-of-order batch records the groups already taken, and a
controller restored from it generates every other group again (g0 too) and never those.
"""

from __future__ import annotations

import asyncio

import pytest

from arl.control.rollout import RolloutController
from arl.control.staleness import StalenessSemaphore
from arl.data.arith import make_arith
from arl.data.loader import StatefulLoader
from arl.node.rollout import data_id
from arl.protocol.remote import rollout_worker
from tests.support.cluster import local_cluster
from tests.support.tiny_model import make_tiny_model

SLOW_S = 6.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def _rows() -> list[dict]:
    rows = make_arith(8, seed=0, split="train")
    rows[0] = {**rows[0], "slow": SLOW_S}
    return rows


async def _worker(node, model: str):
    worker = await node.create(
        "arl.node.rollout:RolloutWorker",
        name="rollout",
        model_path=model,
        workflow="tests.support.objects:SlowWorkflow",
        reward="arl.rewards.arith:arith_reward",
        sampling={"max_new_tokens": 4},
        n_samples=2,
        max_prompt_len=128,
    )
    await rollout_worker(worker).setup()
    return worker


def _controller(worker, node, rows, order: str) -> RolloutController:
    async def free(refs):
        await node.call("free", {"keys": [r.key for r in refs]})

    return RolloutController(
        [worker],
        StatefulLoader(rows, 1, shuffle=False),
        StalenessSemaphore(2, 1, 4),
        peers={node.node_id: node.info["data_addr"]},
        free=free,
        order=order,
    )


@pytest.mark.parametrize("order", ["finished", "submitted"])
def test_a_batch_takes_groups_by_batch_order(tiny_model, order):
    rows = _rows()

    async def main():
        async with local_cluster(1, heartbeat_timeout=30) as (_, (node,), _p):
            rollout = _controller(await _worker(node, tiny_model), node, rows, order)
            rollout.start()
            try:
                batch, infos = await asyncio.wait_for(rollout.prepare_batch(2, 0), 120)
                state = rollout.state_dict()
                rollout.sem.set_version(1)  # as the trainer's sync does
                second, _ = await asyncio.wait_for(rollout.prepare_batch(2, 1), 120)
            finally:
                await rollout.stop()
            keys = [r.key for r in batch.refs]
            return keys, [i.data_id for i in infos], state, [r.key for r in second.refs]

    keys, ids, state, second = asyncio.run(main())
    index = [int(k[1:]) for k in keys]
    assert ids == [data_id(rows[i]) for i in index]
    if order == "finished":
        # g0 was still sleeping: the batch is two later groups, and the checkpoint says so.
        assert 0 not in index and len(set(index)) == 2
        assert state["next_index"] == 0 and state["taken_after"] == sorted(index)
        # At version 1 the groups submitted at 0 (g0..g3) are due within eta = 1: the batch
        # takes the two not yet taken, waiting for g0.
        assert sorted(second) == sorted({"g0", "g1", "g2", "g3"} - set(keys))
    else:
        assert index == [0, 1]
        assert state["next_index"] == 2 and state["taken_after"] == []
        assert second == ["g2", "g3"]


def test_finished_order_keeps_every_group_within_eta_when_several_are_due(tiny_model):
    # eta = 2, one group a batch, g0 and g1 slow: by version 2 both are due, but a batch holds
    # one, so g0 must already be taken at version 1 for g1 to make version 2.
    rows = make_arith(8, seed=0, split="train")
    rows[0], rows[1] = ({**r, "slow": SLOW_S} for r in rows[:2])

    async def main():
        async with local_cluster(1, heartbeat_timeout=30) as (_, (node,), _p):
            rollout = _controller(await _worker(node, tiny_model), node, rows, "finished")
            rollout.sem = StalenessSemaphore(1, 2, 8)
            rollout.start()
            taken = []
            try:
                for version in range(5):
                    batch, infos = await asyncio.wait_for(rollout.prepare_batch(1, version), 120)
                    taken.append((batch.refs[0].key, version - infos[0].min_version))
                    await rollout.resume(version + 1)  # as the trainer's weight sync does
            finally:
                await rollout.stop()
            return taken, rollout.stats

    taken, stats = asyncio.run(main())
    assert taken[0][0] not in ("g0", "g1"), taken  # the first batch did not wait for them
    assert {"g0", "g1"} <= {k for k, _ in taken[:3]}, taken
    assert all(age <= 2 for _, age in taken) and stats.stale_kept == 0, taken


def test_a_resumed_run_skips_the_groups_taken_out_of_order(tiny_model):
    rows = _rows()

    async def main():
        async with local_cluster(1, heartbeat_timeout=30) as (_, (node,), _p):
            worker = await _worker(node, tiny_model)
            first = _controller(worker, node, rows, "finished")
            first.start()
            try:
                batch, _ = await asyncio.wait_for(first.prepare_batch(2, 0), 120)
                state = first.state_dict()
            finally:
                await first.stop()
            await first.free(list(batch.refs))
            taken = [int(r.key[1:]) for r in batch.refs]
            # The resumed run: a fresh loader and semaphore, restored from the checkpoint.
            second = _controller(worker, node, rows, "finished")
            second.run_tag = "r"  # the first run's finished groups still hold their g-keys
            second.load_state_dict(state)
            second.sem.set_version(1)  # the version the first run's batch trained
            second.start()
            try:
                batches = [await asyncio.wait_for(second.prepare_batch(2, 1), 120)]
                second.sem.set_version(2)  # as the trainer's sync does
                batches.append(await asyncio.wait_for(second.prepare_batch(2, 2), 120))
                after = second.state_dict()
            finally:
                await second.stop()
            return taken, [[r.key for r in b.refs] for b, _ in batches], batches, after

    taken, keys, batches, after = asyncio.run(main())
    resumed = [int(k[1:]) for ks in keys for k in ks]
    assert not set(resumed) & set(taken), (taken, resumed)
    assert len(set(resumed)) == 4
    # g0 was running when the checkpoint was taken: it is generated again (submitted at
    # version 1), skipped by the first batch while it sleeps, and due within eta at version 2,
    # so the second waits for it.
    assert "r0" not in keys[0] and "r0" in keys[1]
    for (_batch, infos), ks in zip(batches, keys, strict=True):
        assert [i.data_id for i in infos] == [data_id(rows[int(k[1:])]) for k in ks]
    # The next checkpoint: everything below its first untaken index, and what it lists after
    # that, was trained exactly once.
    done = set(taken) | set(resumed)
    assert set(range(after["next_index"])) | set(after["taken_after"]) <= done
    assert after["next_index"] not in done
