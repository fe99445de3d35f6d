"""Engines sleeping through train phases lose and duplicate no prompt group (counted).

One real rollout node, the hf engine on the CPU. Each "step" takes a batch, then puts the engine
to sleep the way ``rollout.gpu_sharing=sleep`` does (`RolloutController.held(sleep=True)`:
running generations aborted, the KV cache and the weights freed), "trains" while the aborted
generations wait in the engine, and runs a weight sync (`paused`: it wakes the engine, reloads
the weights, stamps the new version, resumes). Every group submitted must be accepted exactly
once, within the staleness bound, and the weights after wake must be the synced ones.
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

BATCH, ETA, STEPS = 2, 1, 4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def test_sleep_wake_around_train_steps_loses_and_duplicates_no_group(tiny_model):
    rows = make_arith(32, seed=0, split="train")

    async def main():
        async with local_cluster(1, heartbeat_timeout=30) as (_, (node,), _p):
            worker = await node.create(
                "arl.node.rollout:RolloutWorker",
                name="rollout",
                model_path=tiny_model,
                reward="arl.rewards.arith:arith_reward",
                # No EOS in a random model's reach: every sample runs its whole budget, so
                # groups are still generating when the engine goes to sleep.
                sampling={"max_new_tokens": 24},
                n_samples=2,
                max_prompt_len=128,
            )
            await rollout_worker(worker).setup()
            before = await worker.call("weights_checksum")

            async def free(refs):
                await node.call("free", {"keys": [r.key for r in refs]})

            rollout = RolloutController(
                [worker],
                StatefulLoader(rows, 1, shuffle=False),
                StalenessSemaphore(BATCH, ETA, 4),
                peers={node.node_id: node.info["data_addr"]},
                free=free,
                order="submitted",
            )
            rollout.start()
            taken, waiting, freed = [], [], []
            try:
                for version in range(STEPS):
                    batch, infos = await asyncio.wait_for(
                        rollout.prepare_batch(BATCH, version), 120
                    )
                    taken += [
                        (r.key, i.data_id, version - i.min_version)
                        for r, i in zip(batch.refs, infos, strict=True)
                    ]
                    async with rollout.held([0], sleep=True, drop_weights=True):
                        freed.append(rollout.sleep_freed_bytes)
                        await asyncio.sleep(0.3)  # the train step; resubmitted requests wait
                        health = await worker.call("health")
                        assert health["asleep"] and health["running"] == 0
                        waiting.append(health["waiting"])
                        async with rollout.paused(version + 1):  # the weight sync
                            assert not (await worker.call("health"))["asleep"]
                            await worker.call("update_weights_from_disk", tiny_model)
                    assert await worker.call("weights_checksum") == before
                # The bound lets (eta + steps + 1) * B groups be accepted: wait for all of them.
                cap = (ETA + STEPS + 1) * BATCH
                while rollout.stats.accepted < cap:
                    await asyncio.sleep(0.05)
                    rollout.check()
                await asyncio.sleep(0.3)  # a group submitted past the bound would show now
            finally:
                await rollout.stop()
            return taken, waiting, freed, rollout.stats

    taken, waiting, freed, stats = asyncio.run(main())
    keys = [k for k, _, _ in taken]
    assert len(keys) == len(set(keys)) == STEPS * BATCH  # no batch took a group twice
    assert stats.submitted == stats.accepted == (ETA + STEPS + 1) * BATCH  # none lost
    assert stats.failed == stats.rejected == stats.stale_dropped == 0
    assert all(age <= ETA for _, _, age in taken), taken
    # Submitted in the loader's order, one row each: no row twice, none skipped.
    assert [d for _, d, _ in taken] == [data_id(r) for r in rows[: STEPS * BATCH]]
    assert all(f > 0 for f in freed)
    assert any(waiting), "no generation was in flight across a sleep: the test proves nothing"
