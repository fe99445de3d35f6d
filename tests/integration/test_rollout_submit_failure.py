"""An error in the rollout controller's submit loop stops rollout with that error, not a hang."""

from __future__ import annotations

import asyncio

import pytest

from arl.control.rollout import RolloutController, RolloutFailed
from arl.control.staleness import StalenessSemaphore
from arl.data.arith import make_arith
from arl.data.loader import StatefulLoader
from arl.protocol.remote import rollout_worker
from tests.support.cluster import local_cluster
from tests.support.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


class BrokenLoader(StatefulLoader):
    """A loader whose rows become unreadable after the first one."""

    def next_batch(self) -> list:
        if self.state_dict()["pos"] >= 1:
            raise OSError("dataset file vanished")
        return super().next_batch()


def test_a_loader_error_in_the_submit_loop_fails_prepare_batch_with_it(tiny_model) -> None:
    rows = make_arith(4, seed=0, split="train")

    async def main() -> BaseException:
        async with local_cluster(1) as (_, (node,), _p):
            worker = await node.create(
                "arl.node.rollout:RolloutWorker",
                model_path=tiny_model,
                reward="arl.rewards.arith:arith_reward",
                n_samples=2,
                sampling={"max_new_tokens": 4},
            )
            await rollout_worker(worker).setup()
            rollout = RolloutController(
                [worker],
                BrokenLoader(rows, 1, shuffle=False),
                StalenessSemaphore(2, 1, 4),
                peers={node.node_id: node.info["data_addr"]},
                free=lambda refs: asyncio.sleep(0),
            )
            rollout.start()
            try:
                with pytest.raises(RolloutFailed) as info:
                    await asyncio.wait_for(rollout.prepare_batch(2, 0), 120)
            finally:
                await rollout.stop()
            return info.value

    err = asyncio.run(main())
    assert "dataset file vanished" in str(err) and isinstance(err.__cause__, OSError)
