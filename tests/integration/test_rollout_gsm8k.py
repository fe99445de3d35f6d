"""Rollout on real nodes: GSM8K prompts, SmolLM2-135M-Instruct on CPU, trajectories as shards."""

from __future__ import annotations

import asyncio

import torch

from arl.data.gsm8k import load_gsm8k
from arl.engines.model import resolve_model
from arl.protocol.proxy import proxy
from arl.protocol.remote import rollout_worker
from arl.protocol.rtensor import RTensor, ShardRef
from arl.workflows.base import TRAJECTORY_KEYS
from tests.support.cluster import local_cluster
from tests.support.objects import Echo


def test_16_prompts_x_4_samples_give_64_well_formed_trajectories(tmp_path, gsm8k_dir):
    model = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    rows, _ = load_gsm8k(str(gsm8k_dir), "test")

    async def main():
        async with local_cluster(2, env={"OMP_NUM_THREADS": "2"}) as (ctl, nodes, _):
            rollout_node, consumer = nodes
            worker = await rollout_node.create(
                "arl.node.rollout:RolloutWorker",
                model_path=model,
                reward="arl.rewards.gsm8k:gsm8k_reward",
                sampling={"max_new_tokens": 32, "temperature": 1.0},
                n_samples=4,
            )
            typed = rollout_worker(worker)
            await typed.setup()
            infos = await asyncio.gather(*(typed.run_group(f"q{i}", rows[i]) for i in range(16)))
            refs = [ShardRef.from_meta(rollout_node.node_id, i["meta"], 4) for i in infos]
            # A second node pulls every group over the data plane, as a train rank would.
            batch = RTensor(refs, peers={rollout_node.node_id: rollout_node.info["data_addr"]})
            echo = proxy(Echo, await consumer.create("tests.support.objects:Echo"))
            shards = await echo.echo(batch.to_wire())
            return infos, shards

    infos, shards = asyncio.run(main())
    assert len(shards) == 16
    n_traj = 0
    for info, shard in zip(infos, shards, strict=True):
        assert set(shard) == set(TRAJECTORY_KEYS)
        ids, att, lm = shard["input_ids"], shard["attention_mask"], shard["loss_mask"]
        assert ids.shape[0] == 4 and ids.shape == att.shape == lm.shape
        assert shard["rewards"].shape == (4,)
        assert set(shard["rewards"].tolist()) <= {0.0, 1.0}
        for i in range(4):
            gen = lm[i]
            n_gen = int(gen.sum())
            assert 1 <= n_gen <= 32
            assert not (gen & ~att[i]).any()  # loss only on real tokens
            # The prompt carries version -1 and no log-prob; generated tokens version 0.
            assert (shard["versions"][i][att[i] & ~gen] == -1).all()
            assert (shard["versions"][i][gen] == 0).all()
            lp = shard["logprobs"][i][gen]
            assert torch.isfinite(lp).all() and (lp <= 0).all()
            assert (shard["logprobs"][i][~gen] == 0).all()
            n_traj += 1
        assert info["n_gen_tokens"] == int(lm.sum())
    assert n_traj == 64
