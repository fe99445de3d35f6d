"""A rollout worker's setup starts what its reward's first call would: arl's math-verify rewards
spawn their verify workers there, so their imports overlap the engine's load instead of the
first batch (`warm_up` in `arl.rewards.gsm8k`'s reward protocol)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from arl.node.rollout import RolloutWorker
from arl.rewards import verify_pool as vp
from tests.support.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def test_setup_starts_the_rewards_verify_workers_before_any_group(tiny_model):
    vp.default_pool().close()  # a fresh, unstarted default pool for this process
    assert vp.default_pool().worker_pids() == []
    worker = RolloutWorker(
        model_path=tiny_model,
        reward="arl.rewards.arith:arith_reward",
        sampling={"max_new_tokens": 4},
        n_samples=2,
    )

    async def main() -> list[int]:
        await worker.setup()
        try:
            return vp.default_pool().worker_pids()
        finally:
            await worker.engine.aclose()

    try:
        pids = asyncio.run(main())
        assert len(pids) == vp.default_pool().n_workers
        # They are the workers the reward then calls: none is replaced by its first calls.
        assert vp.default_pool().verify_sync("12", "\\boxed{12}") == 1.0
        assert vp.default_pool().worker_pids() == pids
    finally:
        vp.default_pool().close()


def test_an_async_warm_up_is_refused_at_setup_naming_the_reward(tiny_model):
    worker = RolloutWorker(
        model_path=tiny_model,
        reward="tests.support.deterministic:async_warm_up_reward",
        node=SimpleNamespace(allowed_prefixes=("arl.", "tests.")),
    )
    with pytest.raises(TypeError, match="async_warm_up_reward.warm_up is async; make it a plain"):
        asyncio.run(worker.setup())


def test_a_plain_def_reward_scores_every_sample_off_the_event_loop(tiny_model):
    worker = RolloutWorker(
        model_path=tiny_model,
        reward="tests.support.deterministic:plain_thread_reward",
        sampling={"max_new_tokens": 4},
        n_samples=3,
        node=SimpleNamespace(allowed_prefixes=("arl.", "tests.")),
    )
    row = {"messages": [{"role": "user", "content": "2*3"}]}

    async def main() -> list[float]:
        await worker.setup()
        try:
            traj = await worker.workflow.arun_episode(worker.engine, row)
            return traj.tensors["rewards"].tolist()
        finally:
            await worker.engine.aclose()

    assert asyncio.run(main()) == [1.0, 1.0, 1.0]
